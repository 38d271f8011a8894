"""The child's watchdog: a tiny separate process that terminates the child's process group
when its wrapper can no longer supervise it.

A wrapper killed with SIGKILL cannot clean up, and one frozen by SIGSTOP (or a long GC pause,
or a swap storm) cannot act, while its lease runs out and a waiter takes the slot. So conch
starts a watchdog (``python -I -S``, no imports beyond the standard library) before it
queues, so that its start-up is long over when the slot comes; it says ``R`` on its stdout
once it runs, and conch starts no child before it has (a watchdog whose script is gone
exits at once). Just before the child starts, conch tells it what to expect; the moment the
child exists, it arms it with the child's process group. It reads a pipe from conch:

* end of file or the goodbye byte before the expect line: exit quietly (conch gave up, or
  died, before there was a child);
* the expect line gives the timeout and environment entries only this child (and what it
  starts) carries, ``CONCH_LEASE`` and ``CONCH_REV``: from here on a child may exist. A
  conch SIGKILLed between the child's start and the arm line (it happened, under load: the
  child ran on unwatched) is handled as below, the processes found by those entries in
  /proc/PID/environ standing in for the group;
* the arm line gives the process group;
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
from collections.abc import Mapping
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
    """A watchdog process, started at once and idle until ``expect(marks, timeout)`` says a
    child is about to start and the seconds of silence after which to terminate it (then
    SIGKILL ``kill_after`` seconds later), and ``arm(pgid)`` names its process group.
    ``heartbeat()`` after each confirmed keepalive,
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

    def expect(self, marks: Mapping[str, str], timeout: float) -> None:
        """A child is about to start with the environment entries ``marks`` (names and
        values without blanks or the goodbye byte, unique to it: its ``CONCH_LEASE`` and
        ``CONCH_REV``); should conch die or fall silent for ``timeout`` seconds before
        ``arm()``, the process groups of the processes carrying them are terminated. Raises
        OSError when the watchdog is gone (the pipe is broken): start no child then."""
        entries = " ".join(f"{name}={value}" for name, value in marks.items())
        self._write(f"e {timeout:.3f} {entries}\n".encode())

    def arm(self, pgid: int) -> None:
        """Guard process group ``pgid`` (the expected child's) from now on. Raises OSError
        when the watchdog is gone (the pipe is broken)."""
        self._write(f"a {pgid}\n".encode())

    def _write(self, line: bytes) -> None:
        assert self._process.stdin is not None
        with self._lock:
            os.write(self._process.stdin.fileno(), line)

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
