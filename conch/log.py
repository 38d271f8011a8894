"""State-transition logging: one line per transition, ``key=value`` pairs.

    conch: event=acquired name=heavy-jobs max=2 rev=8812 waited=1.204s

Values with spaces, quotes or ``=`` are double-quoted. Lines go to the standard ``logging``
logger ``conch`` (INFO for transitions, WARNING and ERROR for trouble), so a service that
embeds the library routes them with the rest of its logs; with no logging set up, Python
shows the warnings and errors on stderr and drops the rest. The command sends every line to
stderr as it is (``to_stderr()``); ``set_quiet(True)`` keeps only warnings and errors,
``set_debug(True)`` adds the DEBUG lines (where each setting came from).
Logging never raises: a closed stderr must not kill a supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

LOGGER = logging.getLogger("conch")
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def set_debug(debug: bool) -> None:
    """The command's ``--debug``: logger ``conch`` at DEBUG (else INFO)."""
    LOGGER.setLevel(logging.DEBUG if debug else logging.INFO)


class _Stderr(logging.Handler):
    """Each line to whatever ``sys.stderr`` is at the time, flushed; errors swallowed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(record.getMessage() + "\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # AttributeError: sys.stderr is None
            pass


def to_stderr() -> None:
    """The command's logging: every line of logger ``conch`` to stderr, and only there."""
    if not any(isinstance(handler, _Stderr) for handler in LOGGER.handlers):
        LOGGER.addHandler(_Stderr())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def _format_value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def _line(level: str, event: str, fields: dict[str, object]) -> str:
    parts = [f"event={event}"]
    if level != "info":
        parts.insert(0, f"level={level}")
    parts.extend(f"{key}={_format_value(value)}" for key, value in fields.items())
    return "conch: " + " ".join(parts)


def _emit(level: int, name: str, event: str, fields: dict[str, object]) -> None:
    if LOGGER.isEnabledFor(level):
        # An embedder's handler that raises must not kill the conch thread that logs (the
        # keepalive thread is the one that declares a lost session).
        with contextlib.suppress(Exception):
            LOGGER.log(level, _line(name, event, fields))


def debug(event: str, **fields: object) -> None:
    _emit(logging.DEBUG, "debug", event, fields)


def info(event: str, **fields: object) -> None:
    if not _quiet:
        _emit(logging.INFO, "info", event, fields)


def warning(event: str, **fields: object) -> None:
    _emit(logging.WARNING, "warning", event, fields)


def error(event: str, **fields: object) -> None:
    _emit(logging.ERROR, "error", event, fields)


def warning_from_signal_handler(event: str, **fields: object) -> None:
    """``warning`` for a signal handler: one os.write to fd 2, not through ``logging``, no
    lock and no buffer (the handler may run in a thread that is inside a handler's emit,
    holding both)."""
    with contextlib.suppress(OSError):
        os.write(2, (_line("warning", event, fields) + "\n").encode("utf-8", "replace"))
