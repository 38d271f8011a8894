"""The child's watchdog: a tiny separate process (``python -I -S conch/_watchdog_main.py``,
standard library only) that terminates the child's process group when its wrapper can no
longer supervise it (SIGKILLed, or frozen while the lease runs out), and kills it before the
lease can expire. Its protocol, one command a line on its pipe from conch, every instant
``time.monotonic()``, is the table in docs/design.md, "The watchdog". Its end shows as the end
of its stdout, its silence as a probe unanswered: conch fails closed on either while the child
runs (``conch.supervisor``).
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
from typing import NamedTuple

from conch import procs
from conch.errors import Interrupted
from conch.flag import Flag, Mailbox

# A script run with -I -S (no site, no user paths), so ``ps`` shows its path, not its source.
_MAIN = os.path.join(os.path.dirname(__file__), "_watchdog_main.py")
# Every variable a credential may come from (a path to a secret is the secret), to withhold
# (here, not in conch.settings: the command starts its watchdog before it imports grpc).
CREDENTIAL_VARIABLES = (
    *(f"CONCH_{name}" for name in ("USER", "PASSWORD", "PASSWORD_FILE", "CERT", "KEY")),
    *(f"ETCDCTL_{name}" for name in ("USER", "PASSWORD", "CERT", "KEY")),
)
READY, FIRED, ANSWER = b"R", b"F", b"A"  # it says: it runs; it fires (SIGTERM); it answers
PROBE, GOODBYE = b"p\n", b"x\n"  # conch says: a probe; goodbye
MARKS = ("CONCH_LEASE", "CONCH_REV")  # the child's alone (and its own children's)
FIRED_READ_TIMEOUT = 0.5  # seconds to let the reader thread take what the watchdog wrote
PROBE_INTERVAL = 0.1  # seconds from one answered probe to the next while the child runs
# Seconds a probe may go unanswered by a watchdog that cannot run (``_halted``; well under the
# deadline's 0.25 s margin), and by one that can (only starved: its own timers still fire), at
# which it is failed as a dead one: the child SIGKILLed at once, exit 70. docs/design.md.
ANSWER_TIMEOUT = 0.1
SLOW_ANSWER_TIMEOUT = 1.0
# /proc/PID/stat states of a process that cannot run by itself (D: a cgroup v1 freezer too).
_HALTED = {"T": "stopped", "t": "traced", "D": "frozen", "Z": "exited", "X": "exited"}


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` less CREDENTIAL_VARIABLES: the child and the watchdog get none."""
    return {name: value for name, value in environ.items() if name not in CREDENTIAL_VARIABLES}


def _halted(pid: int) -> str | None:
    """Why process ``pid`` cannot run by itself (its state in /proc/PID/stat, as _HALTED names
    it; "exited" without one), None if it can (R, S, ...)."""
    stat = procs._stat(pid)
    return "exited" if stat is None else _HALTED.get(stat.state)


class WatchdogNotice(NamedTuple):
    """Put into the supervisor's mailbox when the watchdog process ends before conch dismissed
    it, or leaves a probe unanswered too long (``Watchdog._silent``): ``error`` says which,
    None if it had terminated the child's group first."""

    error: str | None


class Watchdog:
    """A watchdog process, started at once (the command's before its imports) and idle until
    ``expect()`` says a child is about to start, ``arm()`` names its process group;
    ``heartbeat()`` after each confirmed keepalive, ``stand_by()`` while conch terminates the
    group itself, ``dismiss()`` once conch is done with the child (or never had one),
    ``close()`` to see it gone. Every instant is ``time.monotonic()``. ``environ``: the
    environment it starts with (default ``os.environ``) less conch's credentials
    (``without_credentials``). Raises OSError when the process cannot be started."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", _MAIN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=without_credentials(os.environ if environ is None else environ),
            start_new_session=True,  # out of reach of signals sent to conch's group
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout.fileno()
        self.pid = self._process.pid
        # A watchdog that stops reading (SIGSTOPped) must never block the keepalive thread in
        # a heartbeat's write: one that does not fit is dropped, and the watchdog, its expiry
        # not moved on, fires early rather than late.
        os.set_blocking(self._stdin.fileno(), False)
        self._lock = threading.Lock()
        self._dismissed = False
        self._fired = False
        self._reader: threading.Thread | None = None
        self._exited = threading.Event()  # its stdout closed: the process has ended

    def handshake(self, timeout: float, stop: Flag) -> str | None:
        """None if the watchdog runs (it says so within ``timeout`` seconds, or before
        ``stop`` is set, and has not exited since: killed while conch queued) and can run
        (``_halted``, read in /proc rather than asked: no round trip on the handoff's path;
        one stopped while conch queued fails, as a dead one does); else what is wrong, the
        watchdog SIGKILLed (stopped, it would never see its pipe's end). Raises Interrupted
        if ``stop`` is set before it is ready."""
        ready = self._read_for(READY, time.monotonic() + timeout, stop) and not self.ended
        halted = _halted(self.pid) if ready else None
        if ready and halted is None:
            return None
        ended = self.ended or halted == "exited"  # killed while conch queued, or could not start
        self.kill()
        if not ready and stop.is_set():
            raise Interrupted(stop.reason)
        if ended:
            return "the watchdog exited before the child"
        return f"the watchdog cannot run ({halted})" if ready else f"not running after {timeout:g}s"

    def _silent(self, waited: float) -> str | None:
        """Why a probe unanswered for ``waited`` seconds fails the watchdog (past ANSWER_TIMEOUT
        if ``_halted``, SLOW_ANSWER_TIMEOUT if not), None if it does not yet."""
        halted = _halted(self.pid)
        if halted is None and waited < SLOW_ANSWER_TIMEOUT:
            return None
        why = halted or "running, but not scheduled"
        return f"the watchdog did not answer within {waited:.1f}s ({why})"

    def _read_for(self, want: bytes | None, deadline: float, stop: Flag | None = None) -> bool:
        # Read its stdout (no reader thread yet) until ``want`` is in it (None: its end); False
        # at its end, at ``deadline``, or once ``stop`` is set (looked at every 50 ms).
        while stop is None or not stop.is_set():
            left = deadline - time.monotonic()
            if self._readable(min(left, 0.05)):
                chunk = self._take()
                if not chunk:
                    return want is None
                if want is not None and want in chunk:
                    return True
            elif left <= 0:
                return False
        return False

    @property
    def ended(self) -> bool:  # its stdout's end seen, or its exit status
        return self._exited.is_set() or self._process.poll() is not None

    def _readable(self, timeout: float | None) -> bool:
        # A byte (or the end) on its stdout within ``timeout`` seconds, or once more after it (a
        # thread woken late must not miss bytes that came in time)? poll: fds may pass 1024.
        poller = select.poll()
        poller.register(self._stdout, select.POLLIN)
        wait = None if timeout is None else max(0.0, timeout) * 1000
        return bool(poller.poll(wait) or poller.poll(0))

    def _take(self, size: int = 64) -> bytes:  # what it wrote, noting FIRED and the end
        try:
            chunk = os.read(self._stdout, size)
        except (OSError, ValueError):  # closed under us: close() gave up waiting
            chunk = b""
        self._fired = self._fired or FIRED in chunk
        if not chunk:
            self._exited.set()
        return chunk

    def watch(self, box: Mailbox) -> None:
        """From now on (after ``handshake()``), from a thread of its own, probe the watchdog
        every PROBE_INTERVAL and put into ``box`` a WatchdogNotice the first time a probe's
        silence fails it (``_silent``, asked every ANSWER_TIMEOUT while it lasts) and the
        moment its stdout ends (however it dies), unless it was dismissed first."""
        self._reader = threading.Thread(
            target=self._probe_and_read, args=(box,), name="conch-watchdog", daemon=True
        )
        self._reader.start()

    def _probe_and_read(self, box: Mailbox) -> None:
        sent: float | None = None  # when the probe not answered yet went out
        # The next probe (the first a PROBE_INTERVAL in: the handshake has just looked at
        # it); while one is unanswered, the next look at it.
        due = time.monotonic() + PROBE_INTERVAL
        silent = False
        while True:
            wait = None
            if not silent and not self._dismissed:
                if sent is None and time.monotonic() >= due:
                    self._send(PROBE)  # dropped if the pipe is full: then unanswered
                    sent = time.monotonic()
                    due = sent + ANSWER_TIMEOUT
                wait = due - time.monotonic()
            if not self._readable(wait):
                if sent is not None and time.monotonic() >= due:
                    error = self._silent(time.monotonic() - sent)
                    due = time.monotonic() + ANSWER_TIMEOUT
                    silent = error is not None
                    if error is not None and not self._dismissed:
                        box.put(WatchdogNotice(error))
                continue
            chunk = self._take()
            if ANSWER in chunk and sent is not None:
                sent, due = None, time.monotonic() + PROBE_INTERVAL
            if not chunk:
                break
        error = None if self._fired else "the watchdog exited while the child ran"
        if not self._dismissed:
            box.put(WatchdogNotice(error))

    def expect(self, env: Mapping[str, str], margin: float, expiry: float, grace: float) -> None:
        """A child is about to start with the environment ``env``: the watchdog finds its
        processes by the entries named in MARKS (no blanks) until ``arm()``; the lease
        can expire at ``expiry``, the child must be dead ``margin`` seconds before; its SIGKILL
        comes ``grace`` seconds after its SIGTERM. Raises OSError when the watchdog is gone
        (the pipe broken): start no child then."""
        entries = " ".join(f"{name}={env[name]}" for name in MARKS)
        self._write(f"e {margin:.6f} {expiry:.6f} {grace:.3f} {entries}\n".encode())

    def arm(self, pgid: int, expiry: float) -> None:
        """Guard process group ``pgid`` (the expected child's) from now on; the lease can
        expire at ``expiry`` at the earliest (as ``heartbeat()``). Raises OSError when the
        watchdog is gone (the pipe broken)."""
        self._write(f"a {pgid} {expiry:.6f}\n".encode())

    def heartbeat(self, expiry: float) -> None:
        """A keepalive was confirmed: the lease can expire at ``expiry`` at the earliest.
        From the keepalive thread; never raises."""
        self._write(f"h {expiry:.6f}\n".encode(), strict=False)

    def stand_by(self, kill_at: float) -> None:
        """conch terminates the group itself from now on, its SIGKILL at ``kill_at``: the
        watchdog SIGKILLs the group a second after that unless dismissed first, and at the
        lease's deadline at the latest."""
        self._write(f"s {kill_at:.6f}\n".encode(), strict=False)

    def _write(self, line: bytes, strict: bool = True) -> None:
        # strict: raise OSError on a broken pipe; else the line is dropped, also once dismissed.
        with self._lock:
            if strict:
                os.write(self._stdin.fileno(), line)
            elif not self._dismissed:
                self._send(line)

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
        """Dismiss the watchdog, close its pipe and wait up to ``timeout`` seconds for its
        stdout's end (an outer conch would take a watchdog left behind for a process escaped
        from its job); ``reap``: also wait() for it (not where another thread reaps every
        child). Returns whether it ended."""
        self.dismiss()
        with contextlib.suppress(OSError):
            self._stdin.close()
        deadline = time.monotonic() + timeout
        # The reader thread, once started, is the one reading its stdout.
        ended = self._exited.wait(timeout) if self._reader else self._read_for(None, deadline)
        if ended and reap:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(max(0.0, deadline - time.monotonic()))
        return ended

    @property
    def fired(self) -> bool:
        """Whether the watchdog has terminated the group (after ``handshake()``). What it wrote
        is read first: a conch frozen while it fired finds the byte and the child's death
        both waiting as it wakes, in whichever order its threads run."""
        deadline = time.monotonic() + FIRED_READ_TIMEOUT
        # Bytes (or the end) still unread: taken here, or by the reader thread, about to.
        while not self._fired and not self._exited.is_set() and self._readable(0):
            if self._reader is None:
                self._take()
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(0.005)
        return self._fired

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.write(self._stdin.fileno(), data)
