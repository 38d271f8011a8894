"""State-transition logging to stderr: one line per transition, ``key=value`` pairs.

    conch: event=acquired name=heavy-jobs max=2 rev=8812 waited=1.204s

Values with spaces, quotes or ``=`` are double-quoted. ``set_quiet(True)`` keeps only
warnings and errors. Logging never raises: a closed stderr must not kill a supervisor.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_quiet = False
_lock = threading.Lock()


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


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
    return "conch: " + " ".join(parts) + "\n"


def _emit(level: str, event: str, fields: dict[str, object]) -> None:
    line = _line(level, event, fields)
    try:
        with _lock:
            sys.stderr.write(line)
            sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # AttributeError: sys.stderr is None
        pass


def info(event: str, **fields: object) -> None:
    if not _quiet:
        _emit("info", event, fields)


def warning(event: str, **fields: object) -> None:
    _emit("warning", event, fields)


def error(event: str, **fields: object) -> None:
    _emit("error", event, fields)


def warning_from_signal_handler(event: str, **fields: object) -> None:
    """``warning`` for a signal handler: one os.write to fd 2, no lock and no buffer (the
    handler may run in a thread that is inside ``_emit``, holding both)."""
    with contextlib.suppress(OSError):
        os.write(2, _line("warning", event, fields).encode("utf-8", "replace"))
