"""The child's watchdog: a tiny separate process that terminates the child's process group
when its wrapper can no longer supervise it.

A wrapper killed with SIGKILL cannot clean up, and one frozen by SIGSTOP (or a long GC pause,
or a swap storm) cannot act, while its lease runs out and a waiter takes the slot. So conch
starts a watchdog (``python -I -S``, no imports beyond the standard library) before it
queues, so that its start-up is long over when the slot comes; it says ``R`` on its stdout
once it runs, and conch starts no child before it has (a watchdog whose script is gone
exits at once), then arms it with the child's process group the moment the child exists.
It reads a pipe from conch:

* end of file or the goodbye byte before it is armed: exit quietly (conch gave up, or died,
  before there was a child);
* the arm line gives the process group and the timeout;
* a heartbeat byte after every confirmed keepalive pushes its deadline out;
* the goodbye byte means conch itself is done with the child: exit quietly;
* the stand-by byte means conch is terminating the group itself (after a loss, a signal,
  or with stragglers left by the child: SIGTERM now, SIGKILL ``kill_after`` later): no
  heartbeats will come, so silence no longer counts; unless goodbye comes first, the
  watchdog SIGKILLs the group one second after conch should have (conch frozen or killed
  in the middle of it);
* end of file (conch died) or no heartbeat for ``timeout`` seconds (conch frozen): SIGTERM
  the child's process group (and say ``FIRED`` on its stdout), SIGKILL it ``kill_after``
  seconds later if anything is left.

``timeout`` is set past the point where a live conch would itself have declared the session
lost (two keepalive intervals plus two margins), so the watchdog only ever acts for a wrapper
that cannot.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from conch.flag import Flag

HEARTBEAT = b"h"
GOODBYE = b"x"
STAND_BY = b"s"

# The watchdog's own code: a script run with ``python -I -S`` (no site, no user paths, not
# even its own directory on sys.path), so ``ps`` shows its path rather than its source.
_MAIN = str(Path(__file__).with_name("_watchdog_main.py"))
READY = b"R"  # what the watchdog writes to its stdout once it runs
FIRED = b"F"  # ... and when it terminates the group


class Watchdog:
    """A watchdog process, started at once and idle until ``arm(pgid, timeout)`` names the
    process group to guard and the seconds of silence after which to terminate it (then
    SIGKILL ``kill_after`` seconds later). ``heartbeat()`` after each confirmed keepalive,
    ``stand_by()`` while conch terminates the group itself, ``dismiss()`` once conch is
    done with the child (or never had one). Raises OSError when the watchdog process
    cannot be started."""

    def __init__(self, kill_after: float) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", _MAIN, f"{kill_after:.3f}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of signals sent to conch's group
        )
        self._lock = threading.Lock()
        self._dismissed = False
        self._ready = False

    @property
    def pid(self) -> int:
        """The watchdog process's pid."""
        return self._process.pid

    def ready(self, timeout: float, stop: Flag | None = None) -> bool:
        """Whether the watchdog runs: it has said so (waiting up to ``timeout`` seconds for
        that, or until ``stop`` is set; one that cannot start, its script gone in an
        upgrade, exits at once and never says it) and has not exited since (killed while
        conch queued)."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            # In slices: a signal handler's flag does not cut a wait on the pipe short.
            if self._readable(min(left, 0.05)):
                self._ready = os.read(self._stdout(), 1) == READY
                if not self._ready:
                    return False
        return self._process.poll() is None

    def _stdout(self) -> int:
        assert self._process.stdout is not None
        return self._process.stdout.fileno()

    def _readable(self, timeout: float) -> bool:
        """Whether the watchdog's stdout has a byte within ``timeout`` seconds (poll, not
        select: an embedding service may hold more than 1024 descriptors)."""
        poller = select.poll()
        poller.register(self._stdout(), select.POLLIN)
        return bool(poller.poll(timeout * 1000))

    def arm(self, pgid: int, timeout: float) -> None:
        """Guard process group ``pgid`` from now on. Raises OSError when the watchdog is
        gone (the pipe is broken)."""
        assert self._process.stdin is not None
        with self._lock:
            os.write(self._process.stdin.fileno(), f"a {pgid} {timeout:.3f}\n".encode())

    def heartbeat(self) -> None:
        """Push the deadline out (called from the keepalive thread; never raises)."""
        with self._lock:
            if not self._dismissed:
                self._send(HEARTBEAT)

    def stand_by(self) -> None:
        """conch terminates the group itself from now on: the watchdog stops counting
        silence (no heartbeats come after a loss), and SIGKILLs the group ``kill_after``
        + 1 seconds from now unless dismissed first (conch frozen or dead meanwhile)."""
        with self._lock:
            if not self._dismissed:
                self._send(STAND_BY)

    def dismiss(self) -> None:
        """conch is done with the child: the watchdog exits without killing anything. Does
        not wait for it; it is reaped later or by init."""
        with self._lock:
            if self._dismissed:
                return
            self._dismissed = True
            self._send(GOODBYE)
            if self._process.stdin is not None:
                with contextlib.suppress(OSError):
                    self._process.stdin.close()

    @property
    def fired(self) -> bool:
        """Whether the watchdog has terminated the group (after ``ready()``)."""
        return self._readable(0) and os.read(self._stdout(), 1) == FIRED

    def _send(self, byte: bytes) -> None:
        assert self._process.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            os.write(self._process.stdin.fileno(), byte)
