"""State-transition logging (docs/operations.md "Logs"): one line per transition,
``conch: event=acquired name=heavy-jobs max=2 rev=8812 waited=1.204s``, to the ``logging``
logger ``conch`` (INFO for transitions, WARNING and ERROR for trouble), its fields also as
``extra``; the command's goes to stderr (``to_stderr()``). Logging never raises: a closed
stderr must not kill a supervisor. Every transition also goes, as a typed event, to the
callbacks of ``conch.events``, whatever the level."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LOGGER = logging.getLogger("conch")
_quiet = False
# Set by conch.events when imported: ``hook(event, fields)`` for every transition.
hook: Callable[[str, dict[str, object]], None] | None = None


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


class _Stderr(logging.Handler):
    """Each line to whatever ``sys.stderr`` is at the time, flushed; errors swallowed."""

    def emit(self, record: logging.LogRecord) -> None:
        # AttributeError: sys.stderr is None
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.write(record.getMessage() + "\n")
            sys.stderr.flush()


def to_stderr() -> None:
    """The command's logging: every line of logger ``conch`` to stderr, and only there."""
    if not any(isinstance(handler, _Stderr) for handler in LOGGER.handlers):
        LOGGER.addHandler(_Stderr())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def _line(level: str, event: str, fields: dict[str, object]) -> str:
    words = [f"event={event}"] if level == "info" else [f"level={level}", f"event={event}"]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\\') or not text.isprintable():
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        words.append(f"{key}={text}")
    return "conch: " + " ".join(words)


# What a LogRecord already has (and makeRecord refuses to overwrite), or a formatter adds.
_RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _emit(level: int, /, event: str, **fields: object) -> None:
    # An embedder's handler or hook that raises must not kill the conch thread that logs.
    if hook is not None:
        with contextlib.suppress(Exception):
            hook(event, fields)
    if not (level == logging.INFO and _quiet) and LOGGER.isEnabledFor(level):
        with contextlib.suppress(Exception):
            extra = {f"conch_{k}" if k in _RESERVED else k: v for k, v in fields.items()}
            extra.update(conch_event=event, conch_fields=dict(fields))
            line = _line(logging.getLevelName(level).lower(), event, fields)
            LOGGER.log(level, line, extra=extra)


# ``info(event, **fields)``: one line for ``event``, its fields in order.
debug = functools.partial(_emit, logging.DEBUG)
info = functools.partial(_emit, logging.INFO)
warning = functools.partial(_emit, logging.WARNING)
error = functools.partial(_emit, logging.ERROR)


def call_back(callback: Callable[[T], object], argument: T, **fields: object) -> None:
    """``callback(argument)``; an exception it raises is logged (``callback-failed``, with
    ``fields``), not raised: one embedder's bug must not silence the others."""
    try:
        callback(argument)
    except Exception as exc:
        error("callback-failed", **fields, error=repr(exc))


def warning_from_signal_handler(event: str, **fields: object) -> None:
    """``warning`` for a signal handler: one os.write to fd 2, not through ``logging``, no
    lock and no buffer (the handler may run in a thread that is inside a handler's emit,
    holding both)."""
    with contextlib.suppress(OSError):
        os.write(2, (_line("warning", event, fields) + "\n").encode("utf-8", "replace"))
