"""State-transition logging: one line per transition, ``key=value`` pairs.

    conch: event=acquired name=heavy-jobs max=2 rev=8812 waited=1.204s

Values with spaces, quotes or ``=`` are double-quoted. Lines go to the standard ``logging``
logger ``conch`` (INFO for transitions, WARNING and ERROR for trouble), so a service that
embeds the library routes them with the rest of its logs; with no logging set up, Python
shows the warnings and errors on stderr and drops the rest. The command sends every line to
stderr as it is (``to_stderr()``); ``set_quiet(True)`` keeps only warnings and errors,
``set_debug(True)`` adds the DEBUG lines (where each setting came from).
Logging never raises: a closed stderr must not kill a supervisor.

Each record also carries its fields as attributes (``logging``'s ``extra``), so a structured
handler (python-json-logger, structlog's stdlib bridge, an OpenTelemetry log handler) emits
them as fields, not as text to parse: ``conch_event`` (``acquired``), then each field under
its own name (``rev``, ``lease``, ``waited``, ...), values as in the line (durations are
strings such as ``"1.204s"``). A field whose name is one of ``logging.LogRecord``'s own
attributes (``name``: the semaphore's) is given as ``conch_<field>`` (``conch_name``).
``conch_fields`` has them all under their own names, in one dict. Every transition is also
handed, as a typed event, to the callbacks subscribed in ``conch.events``, whatever the
logging level or ``--quiet``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable

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


# What a LogRecord already has (and makeRecord refuses to overwrite), or a formatter adds.
_RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _extra(event: str, fields: dict[str, object]) -> dict[str, object]:
    extra: dict[str, object] = {"conch_event": event, "conch_fields": dict(fields)}
    for key, value in fields.items():
        extra[f"conch_{key}" if key in _RESERVED else key] = value
    return extra


def _emit(level: int, name: str, event: str, fields: dict[str, object]) -> None:
    # An embedder's handler or hook that raises must not kill the conch thread that logs
    # (the keepalive thread is the one that declares a lost session).
    if _hooks is not None:
        with contextlib.suppress(Exception):
            _hooks(event, fields)
    if level == logging.INFO and _quiet:
        return
    if LOGGER.isEnabledFor(level):
        with contextlib.suppress(Exception):
            LOGGER.log(level, _line(name, event, fields), extra=_extra(event, fields))


# conch.events' dispatcher, set when its first callback is subscribed: the one place every
# transition passes, so neither face has code of its own for the hooks.
_hooks: Callable[[str, dict[str, object]], None] | None = None


def set_hooks(dispatch: Callable[[str, dict[str, object]], None] | None) -> None:
    """For ``conch.events`` only: ``dispatch(event, fields)`` for every line, logged or not."""
    global _hooks
    _hooks = dispatch


def debug(event: str, **fields: object) -> None:
    _emit(logging.DEBUG, "debug", event, fields)


def info(event: str, **fields: object) -> None:
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
