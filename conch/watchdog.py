"""The child's watchdog: a tiny separate process that terminates the child's process group
when its wrapper can no longer supervise it, and kills it before the lease can expire.

A wrapper killed with SIGKILL cannot clean up, and one frozen by SIGSTOP (or a long GC pause,
or a swap storm) cannot act, while its lease runs out and a waiter takes the slot. So conch
starts a watchdog (``python -I -S``, no imports beyond the standard library) before it
queues, so that its start-up is long over when the slot comes; it says ``R`` on its stdout
once it runs, and conch starts no child before it has (a watchdog whose script is gone
exits at once). Just before the child starts, conch tells it what to expect; the moment the
child exists, it arms it with the child's process group. Its pipe from conch carries one
command a line; every instant is ``time.monotonic()`` (CLOCK_MONOTONIC, system-wide on
Linux, so conch's instants are the watchdog's):

* end of file or goodbye before the expect line: exit quietly (conch gave up, or died,
  before there was a child);
* ``e MARGIN EXPIRY MARKS...``: a child is about to start; the lease can expire at EXPIRY,
  and the child must be dead MARGIN seconds before that. MARKS are the environment entries
  only this child (and what it starts) carries, ``CONCH_LEASE`` and ``CONCH_REV``: a conch
  SIGKILLed between the child's start and the arm line (it happened, under load: the child
  ran on unwatched) is handled as below, the processes found by those entries in
  /proc/PID/environ standing in for the group;
* ``a PGID``: the child's process group;
* ``h EXPIRY`` after every confirmed keepalive: the lease's new earliest expiry;
* ``p`` (a probe, once before the expect line and every PROBE_INTERVAL while the child
  runs): answered ``A`` on its stdout at once; a watchdog that has not answered within
  ANSWER_TIMEOUT is failed as a dead one (before the expect line: no child is started);
* ``x`` (goodbye): conch itself is done with the child: exit quietly once conch closes the
  pipe (at most a fifth of a second later);
* ``s KILL_AT`` (stand-by): conch is terminating the group itself (after a loss, a signal,
  or with stragglers left by the child) and sends its SIGKILL at KILL_AT: unless goodbye
  comes first, the watchdog SIGKILLs the group one second after that (conch frozen or
  killed in the middle of it), and at EXPIRY - MARGIN at the latest;
* the deadline: no keepalive confirmed in time (conch frozen), SIGTERM the group at
  EXPIRY - MARGIN - KILL_AFTER (a fifth of a second after conch itself would: the child
  never gets both) and say ``F`` on its stdout, SIGKILL it at EXPIRY - MARGIN, whether or
  not conch ever wakes again;
* end of file after the expect line (conch died): SIGTERM the group at once, SIGKILL it
  KILL_AFTER later, or at EXPIRY - MARGIN if that comes first.

The watchdog's own end shows as the end of its stdout, its silence as a probe unanswered:
conch watches both while the child runs, and fails closed when its watchdog is gone or
stopped (see ``conch.supervisor``). The kernel wakes a stopped watchdog when conch dies
(``PR_SET_PDEATHSIG`` with SIGCONT), so that a conch SIGKILLed before it could notice the
silence still leaves its child to the watchdog.
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
from typing import NamedTuple

from conch.flag import Flag, Mailbox
from conch.settings import CREDENTIAL_VARIABLES

GOODBYE = b"x\n"

# The watchdog's own code: a script run with ``python -I -S`` (no site, no user paths, not
# even its own directory on sys.path), so ``ps`` shows its path rather than its source.
_MAIN = str(Path(__file__).with_name("_watchdog_main.py"))
READY = b"R"  # what the watchdog writes to its stdout once it runs
FIRED = b"F"  # ... and when it terminates the group
FIRED_READ_TIMEOUT = 0.5  # seconds to let the reader thread take what the watchdog wrote
PROBE = b"p\n"  # conch's probe, on the watchdog's pipe
ANSWER = b"A"  # ... and the watchdog's answer, on its stdout
PROBE_INTERVAL = 0.1
"""Seconds from one answered probe to the next, while the child runs. With ANSWER_TIMEOUT,
how soon a watchdog stopped (SIGSTOP, a debugger, a freezer) is noticed: a conch that is
frozen or killed later than that finds its child already dead."""
ANSWER_TIMEOUT = 0.1
"""Seconds within which the watchdog must answer a probe, else it is failed as a dead one
(the child SIGKILLed at once, exit 70). Well under the deadline's margin (0.25 s, which
counts the watchdog's wake-up on a loaded host among what it covers): a watchdog that cannot
answer that fast cannot be trusted to SIGKILL by the deadline either."""

# conch's credentials, as conch and etcdctl read them from the environment (``CONCH_USER``
# and ``ETCDCTL_USER`` may hold NAME:PASSWORD), the paths to secrets among them alike (the
# password file, the client certificate and its key): the child and the watchdog start
# without them, so no job conch runs is handed the cluster's credentials. The CA bundle and
# the endpoints, no secrets, are passed on.
CREDENTIALS = CREDENTIAL_VARIABLES


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` less every entry of CREDENTIALS."""
    return {name: value for name, value in environ.items() if name not in CREDENTIALS}


class WatchdogExited(NamedTuple):
    """Put into the supervisor's mailbox when the watchdog process ends before conch
    dismissed it; ``fired``: whether it had terminated the child's group first."""

    fired: bool


class WatchdogSilent(NamedTuple):
    """Put into the supervisor's mailbox when the watchdog has not answered a probe within
    ``after`` seconds (ANSWER_TIMEOUT): stopped, or too starved to keep the deadline."""

    after: float


class Watchdog:
    """A watchdog process, started at once and idle until ``expect(marks, margin, expiry)``
    says a child is about to start, that the lease can expire at ``expiry`` and the child
    must be dead ``margin`` seconds before (SIGTERM ``kill_after`` seconds before that), and
    ``arm(pgid)`` names its process group. ``heartbeat(expiry)`` after each confirmed
    keepalive, ``stand_by(kill_at)`` while conch terminates the group itself, ``dismiss()``
    once conch is done with the child (or never had one), ``close()`` to see it gone.
    ``watch(box)`` reports its end. ``environ`` is the environment it starts with (default
    ``os.environ``), less CREDENTIALS. Raises OSError when the watchdog process cannot be
    started."""

    def __init__(self, kill_after: float, environ: Mapping[str, str] | None = None) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", _MAIN, f"{kill_after:.3f}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=without_credentials(os.environ if environ is None else environ),
            start_new_session=True,  # out of reach of signals sent to conch's group
        )
        assert self._process.stdin is not None
        # A watchdog that stops reading (frozen by someone's SIGSTOP) must never block the
        # keepalive thread in a heartbeat's write: one that does not fit is dropped, and the
        # watchdog, its expiry not moved on, fires early rather than late.
        os.set_blocking(self._process.stdin.fileno(), False)
        self._lock = threading.Lock()
        self._dismissed = False
        self._ready = False
        self._fired = False
        self._reader: threading.Thread | None = None
        self._exited = threading.Event()  # its stdout closed: the process has ended

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
        return self._process.poll() is None and not self._exited.is_set()

    def answers(self, timeout: float) -> bool:
        """Whether the watchdog, ready and not watched yet, answers a probe within
        ``timeout`` seconds (ANSWER_TIMEOUT): one stopped while conch queued (SIGSTOP, a
        debugger, a freezer) is failed before the child starts, as a dead one is, rather
        than once the child runs."""
        self._send(PROBE)
        deadline = time.monotonic() + timeout
        while True:
            # Once more after the deadline: a thread of ours woken late must not take an
            # answer that came in time for a late one.
            if not self._readable(deadline - time.monotonic()) and not self._readable(0):
                return False
            try:
                chunk = os.read(self._stdout(), 64)
            except OSError:
                chunk = b""
            if ANSWER in chunk:
                return True
            if not chunk:
                self._exited.set()
                return False

    @property
    def ended(self) -> bool:
        """Whether the watchdog process is known to have ended (its stdout's end seen, or
        its exit status)."""
        return self._exited.is_set() or self._process.poll() is not None

    def _stdout(self) -> int:
        assert self._process.stdout is not None
        return self._process.stdout.fileno()

    def _readable(self, timeout: float | None) -> bool:
        """Whether the watchdog's stdout has a byte (or its end) within ``timeout`` seconds
        (None: however long it takes; poll, not select: an embedding service may hold more
        than 1024 descriptors)."""
        poller = select.poll()
        poller.register(self._stdout(), select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def watch(self, box: Mailbox) -> None:
        """From now on (after ``ready()``), probe the watchdog every PROBE_INTERVAL and put
        a WatchdogSilent into ``box`` the first time it does not answer within
        ANSWER_TIMEOUT, and a WatchdogExited the moment it ends (its stdout's end: the
        kernel closes it as the process exits, however it dies), unless it was dismissed
        first. One thread of its own does both. A heartbeat needs no answer of its own: the
        watchdog reads its pipe in order, so the answer to the next probe acknowledges it."""
        self._reader = threading.Thread(
            target=self._probe_and_read, args=(box,), name="conch-watchdog", daemon=True
        )
        self._reader.start()

    def _probe_and_read(self, box: Mailbox) -> None:
        sent: float | None = None  # when the probe not answered yet went out
        next_probe = time.monotonic()
        silent = False
        while True:
            wait = None
            if not silent and not self._dismissed:
                if sent is None and time.monotonic() >= next_probe:
                    self._send(PROBE)  # dropped if the pipe is full: then unanswered
                    sent = time.monotonic()
                until = next_probe if sent is None else sent + ANSWER_TIMEOUT
                wait = until - time.monotonic()
            # Once more before the verdict: a thread of ours woken late (the GIL) must not
            # take an answer that came in time for a late one.
            if not self._readable(wait) and not self._readable(0):
                if sent is not None and time.monotonic() - sent >= ANSWER_TIMEOUT:
                    silent = True
                    if not self._dismissed:
                        box.put(WatchdogSilent(ANSWER_TIMEOUT))
                continue
            try:
                chunk = os.read(self._stdout(), 64)
            except (OSError, ValueError):  # closed under us: close() gave up waiting
                chunk = b""
            if FIRED in chunk:
                self._fired = True
            if ANSWER in chunk and sent is not None:
                sent, next_probe = None, time.monotonic() + PROBE_INTERVAL
            if not chunk:
                break
        self._exited.set()
        if not self._dismissed:
            box.put(WatchdogExited(self._fired))

    def expect(self, marks: Mapping[str, str], margin: float, expiry: float) -> None:
        """A child is about to start with the environment entries ``marks`` (names and
        values without blanks, unique to it: its ``CONCH_LEASE`` and ``CONCH_REV``); the
        lease can expire at ``expiry`` (``time.monotonic()``), and the child must be dead
        ``margin`` seconds before. Should conch die or fall silent before ``arm()``, the
        process groups of the processes carrying the marks are terminated. Raises OSError
        when the watchdog is gone (the pipe is broken): start no child then."""
        entries = " ".join(f"{name}={value}" for name, value in marks.items())
        self._write(f"e {margin:.6f} {expiry:.6f} {entries}\n".encode())

    def arm(self, pgid: int) -> None:
        """Guard process group ``pgid`` (the expected child's) from now on. Raises OSError
        when the watchdog is gone (the pipe is broken)."""
        self._write(f"a {pgid}\n".encode())

    def _write(self, line: bytes) -> None:
        assert self._process.stdin is not None
        with self._lock:
            os.write(self._process.stdin.fileno(), line)

    def heartbeat(self, expiry: float) -> None:
        """A keepalive was confirmed: the lease can expire at ``expiry``
        (``time.monotonic()``) at the earliest. Called from the keepalive thread; never
        raises."""
        with self._lock:
            if not self._dismissed:
                self._send(f"h {expiry:.6f}\n".encode())

    def stand_by(self, kill_at: float) -> None:
        """conch terminates the group itself from now on and sends SIGKILL at ``kill_at``
        (``time.monotonic()``): the watchdog SIGKILLs the group a second after that unless
        dismissed first (conch frozen or dead meanwhile), and at the lease's deadline at the
        latest."""
        with self._lock:
            if not self._dismissed:
                self._send(f"s {kill_at:.6f}\n".encode())

    def kill(self) -> None:
        """SIGKILL the watchdog process (one failed for its silence: stopped, it would
        otherwise wake one day and act on a process group long gone)."""
        with contextlib.suppress(OSError):
            self._process.kill()

    def dismiss(self) -> None:
        """conch is done with the child: the watchdog exits without killing anything, once
        ``close()`` closes its pipe (or a fifth of a second later). Does not wait for it."""
        with self._lock:
            if self._dismissed:
                return
            self._dismissed = True
            self._send(GOODBYE)

    def close(self, timeout: float, reap: bool = True) -> bool:
        """Dismiss the watchdog, close its pipe and wait up to ``timeout`` seconds for it to
        end (its stdout's end): a conch that exits right after leaves no watchdog behind to
        be re-parented (an outer conch would take it for a process escaped from its job).
        ``reap``: also wait() for it (not where another thread reaps every child). Returns
        whether it ended."""
        self.dismiss()
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        deadline = time.monotonic() + timeout
        # The reader thread, once started, is the one reading its stdout.
        ended = self._exited.wait(timeout) if self._reader else self._drain(deadline)
        if ended and reap:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(max(0.0, deadline - time.monotonic()))
        return ended

    def _drain(self, deadline: float) -> bool:
        """Read the watchdog's stdout to its end, until ``deadline``; whether it ended."""
        while (left := deadline - time.monotonic()) > 0:
            if self._readable(left):
                try:
                    chunk = os.read(self._stdout(), 64)
                except OSError:
                    chunk = b""
                self._fired = self._fired or FIRED in chunk
                if not chunk:
                    self._exited.set()
                    return True
        return False

    @property
    def fired(self) -> bool:
        """Whether the watchdog has terminated the group (after ``ready()``). What it wrote
        before is read first: a conch frozen while its watchdog fired finds the byte, and
        the child's death, both waiting as it wakes, in whichever order its threads run."""
        if self._reader is None:
            if not self._exited.is_set() and self._readable(0):
                chunk = os.read(self._stdout(), 64)
                self._fired = self._fired or FIRED in chunk
                if not chunk:
                    self._exited.set()
            return self._fired
        deadline = time.monotonic() + FIRED_READ_TIMEOUT
        # Bytes (or the end) still unread: the reader thread is about to take them.
        while not self._fired and not self._exited.is_set() and self._readable(0):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return self._fired

    def _send(self, data: bytes) -> None:
        assert self._process.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            os.write(self._process.stdin.fileno(), data)
