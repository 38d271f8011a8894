"""The child's watchdog: a tiny separate process that terminates the child's process group
when its wrapper can no longer supervise it.

A wrapper killed with SIGKILL cannot clean up, and one frozen by SIGSTOP (or a long GC pause,
or a swap storm) cannot act, while its lease runs out and a waiter takes the slot. So conch
starts a watchdog (``python -I -S -c``, no imports beyond the standard library) before it
queues, so that its start-up is long over when the slot comes, and arms it with the child's
process group the moment the child exists. It reads a pipe from conch:

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

HEARTBEAT = b"h"
GOODBYE = b"x"
STAND_BY = b"s"

_CODE = r"""
import os, select, signal, sys, time
kill_after = float(sys.argv[1])
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
    signal.signal(sig, signal.SIG_IGN)
def leave():
    # Goodbye comes as conch releases its slot and the next holder starts: exiting a moment
    # later keeps this process's teardown from competing with that start for the CPU.
    time.sleep(0.2)
    os._exit(0)
line = b""
while b"\n" not in line:
    data = os.read(0, 256)
    if not data or b"x" in data:
        leave()
    line += data
line, _, data = line.partition(b"\n")
pgid, timeout = int(line.split()[1]), float(line.split()[2])
deadline = time.monotonic() + timeout
standby = None
while True:
    if b"x" in data:
        leave()
    if b"s" in data and standby is None:
        # conch terminates the group itself now: SIGTERM, SIGKILL kill_after later. If it
        # has not said goodbye a second after that (frozen or dead), SIGKILL is ours.
        standby = time.monotonic() + kill_after + 1.0
    until = deadline if standby is None else standby
    ready, _, _ = select.select([0], [], [], max(0.0, until - time.monotonic()))
    if not ready:
        break
    data = os.read(0, 256)
    if not data:
        break
    if standby is None:
        deadline = time.monotonic() + timeout
if standby is not None:
    time.sleep(max(0.0, standby - time.monotonic()))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)
try:
    os.write(1, b"F")  # before the signal: conch must know by the time the child is gone
except OSError:
    pass
try:
    os.killpg(pgid, signal.SIGTERM)
except ProcessLookupError:
    sys.exit(0)
end = time.monotonic() + kill_after
while time.monotonic() < end:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(0.05)
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""
FIRED = b"F"  # what the watchdog writes to its stdout when it terminates the group


class Watchdog:
    """A watchdog process, started at once and idle until ``arm(pgid, timeout)`` names the
    process group to guard and the seconds of silence after which to terminate it (then
    SIGKILL ``kill_after`` seconds later). ``heartbeat()`` after each confirmed keepalive,
    ``stand_by()`` while conch terminates the group itself, ``dismiss()`` once conch is
    done with the child (or never had one). Raises OSError when the watchdog process
    cannot be started."""

    def __init__(self, kill_after: float) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CODE, f"{kill_after:.3f}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of signals sent to conch's group
        )
        self._lock = threading.Lock()
        self._dismissed = False

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
        """Whether the watchdog has terminated the group."""
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], 0)
        return bool(ready) and os.read(fd, 1) == FIRED

    def _send(self, byte: bytes) -> None:
        assert self._process.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            os.write(self._process.stdin.fileno(), byte)
