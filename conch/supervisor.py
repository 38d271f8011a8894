"""The supervision loop (contract section 7): acquire, run the child, child exit or loss,
terminate, release. Written once; the CLI and embedders call ``supervise``.

Read as ``flock.c`` reads: every way a round can end is an ``Outcome``, and ``EXIT_CODES`` is
the one table from outcomes to exit codes. The file's parts, in order: the deadline and the
outcomes; the supervision itself (one round: watchdog, hold, spawn, wait, terminate,
report); the signals conch takes; the spawn; the reaper (which only reaps and tells: it makes
no call to etcd); the /proc scans; the job and its termination.

The deadline. While the child runs, the lease's earliest expiry E (``Session.alive_until``:
the send time of the last keepalive etcd answered, plus the TTL it granted; etcd restarts
the countdown on receipt, after we sent) is an instant on our monotonic clock. The child is
SIGKILLed by E - ``deadline_margin(ttl)`` at the latest, and SIGTERMed ``kill_after``
before that, whether or not the session has declared a loss yet: planned back from E,
so that no waiter can take the slot while the child still runs, whatever it does with
SIGTERM. The watchdog holds the same deadline for a wrapper that is frozen or dead.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from conch import etcd, hints, log
from conch.core.loss import Loss
from conch.errors import (
    EX_CANNOT_EXECUTE,
    EX_NOT_FOUND,
    EX_SOFTWARE,
    EX_TEMPFAIL,
    HoldLost,
    Interrupted,
    UsageError,
)
from conch.etcd.client import Backoff
from conch.flag import Flag, Mailbox, remaining
from conch.hold import Hold
from conch.semaphore import REENTRY_BACKOFF_CAP, Semaphore
from conch.session import keepalive_margin
from conch.watchdog import Watchdog, WatchdogExited, without_credentials

_adopting = False  # adopt_orphans() worked: every child of this process is ours to reap
# Taken by the adopting reaper while it reaps; reentrant: an error path that kills a child
# it has just spawned (holding it) also looks for what escaped.
_reap_lock = threading.RLock()
# Set when we start a process: the adopting reaper, idle for want of children, looks again at
# once instead of after GROUP_POLL (a child that exits within it was noticed up to 50 ms late).
_spawned = threading.Event()
_claimed: dict[int, Callable[[int], None]] = {}  # our children's pids -> their exit callbacks
# Our children that are no job's (watchdogs): pid -> start time, until reaped by us (one
# reaped by Popen stays: its start time tells it from a later process with its pid).
_beside_jobs: dict[int, int] = {}

# Every signal whose default action ends the process, that can be caught, and that is sent to
# ask a process to stop (a user, a terminal's ^C or ^\, a timer, a CPU limit): each stops conch
# as SIGTERM does (withdraw while queued; terminate the child, release). Left out: SIGKILL and
# SIGSTOP (cannot be caught: the watchdog's job); SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP,
# SIGSYS and SIGABRT, which report a fault in conch itself (a Python handler would return to
# the faulting instruction, or hide a crash); SIGPIPE and SIGXFSZ, which Python ignores (a
# write fails with EPIPE or EFBIG instead of killing us, and a log line to a closed stderr
# must not stop the supervision).
STOP_SIGNALS: tuple[int, ...] = (
    *(
        getattr(signal, name)
        for name in (
            "SIGHUP",
            "SIGINT",
            "SIGQUIT",
            "SIGUSR1",
            "SIGUSR2",
            "SIGALRM",
            "SIGTERM",
            "SIGSTKFLT",
            "SIGXCPU",
            "SIGVTALRM",
            "SIGPROF",
            "SIGIO",
            "SIGPWR",
        )
        if hasattr(signal, name)
    ),
    *(range(signal.SIGRTMIN, signal.SIGRTMAX + 1) if hasattr(signal, "SIGRTMIN") else ()),
)
# Signals that stay ignored if they are when we start (nohup's SIGHUP; a script's background
# job, which ignores SIGINT and SIGQUIT): whoever started us said they must not stop us. Not
# SIGTERM: it is how conch, and its watchdog, stop the child.
KEEP_IGNORED = (*(sig for sig in STOP_SIGNALS if sig != signal.SIGTERM), signal.SIGTSTP)
GROUP_POLL = 0.05  # seconds between checks that a process group is empty
SHELL = "/bin/sh"  # runs a script the kernel cannot execute, as execvp(3) does
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
# What only this child, and what it starts, carries in its environment: how the watchdog finds
# them while it does not know the child's process group yet.
_MARKS = ("CONCH_LEASE", "CONCH_REV")
GONE_AFTER_KILL = 2.0  # seconds to wait for SIGKILLed stragglers to be gone (zombies may stay)
REAP_AFTER_KILL = 10.0  # seconds to wait for a SIGKILLed child (stuck in D state: give up)
WATCHDOG_START_TIMEOUT = 10.0  # seconds for the watchdog to say it runs, before the child

WATCHDOG_EXIT_TIMEOUT = 1.0  # seconds to wait for a dismissed watchdog to be gone

# -- the deadline ---------------------------------------------------------------------------

DEADLINE_MARGIN = 0.25
"""Seconds before the lease's earliest expiry by which the child is SIGKILLed, plus
CLOCK_RATE_TOLERANCE of the TTL (``deadline_margin``). What it covers: the supervisor's or
the watchdog's wake-up on a loaded host (a thread scheduled late, the GIL held by another
thread: tens of milliseconds measured on a busy 2-core machine, see
docs/failure-semantics.md), the SIGKILL's delivery (the kernel ends the process when it is
next scheduled, a few milliseconds), and etcd's side, which only ever expires later than E
(its leader checks expiries every 500 ms, and a new leader extends every lease)."""

CLOCK_RATE_TOLERANCE = 0.001
"""How much faster etcd's leader's clock may run than ours, as a fraction: the TTL is
counted on each host's own clock. NTP and chrony slew a clock by at most 500 ppm (0.05 %);
twice that, for both hosts: 10 ms of a 10 s TTL."""


def deadline_margin(ttl: float) -> float:
    """Seconds before the lease's earliest expiry (TTL ``ttl`` seconds) by which the child
    must be dead: DEADLINE_MARGIN + CLOCK_RATE_TOLERANCE * ``ttl``."""
    return DEADLINE_MARGIN + CLOCK_RATE_TOLERANCE * ttl


def max_kill_after(ttl: float) -> float:
    """The longest grace (seconds between SIGTERM and SIGKILL) that fits a lease of ``ttl``
    seconds: ``ttl`` less one keepalive interval (TTL/3), the session's keepalive margin and
    the deadline margin. The SIGTERM, planned back from the lease's earliest expiry, then
    comes no earlier than the session would declare an unanswered keepalive lost: a longer
    grace would SIGTERM the children of healthy holders whose keepalive is merely slow.
    1.25 s for a TTL of 3 s, 5.4 s for 10 s, 12 s for 20 s. A grace that long leaves a
    keepalive only the keepalive margin (0.5 s at a TTL of 3 s, 1 s at 10 s) to be answered
    before the SIGTERM: the default (``default_kill_after``) leaves it its whole patience."""
    return max(0.0, ttl - ttl / 3 - keepalive_margin(ttl) - deadline_margin(ttl))


def default_kill_after(ttl: float, asked: float = 5.0) -> float:
    """The grace (seconds) conch gives when none is asked for: ``asked`` (the documented 5 s),
    or less where the TTL cannot give that and still leave each keepalive its whole patience
    (an interval plus the keepalive margin before the session calls it missing): the deadline
    then never gives up on a slow keepalive sooner than the session itself would. 0.25 s
    at a TTL of 3 s, 2.07 s at 10 s, 5 s from 19 s up. ``max_kill_after`` is the longest an
    operator may ask for, trading that patience for grace."""
    return max(0.0, min(asked, ttl / 3 - keepalive_margin(ttl) - deadline_margin(ttl)))


def check_kill_after(kill_after: float, ttl: float, flag: str = "kill_after") -> None:
    """Raise UsageError (exit 64) unless a grace of ``kill_after`` seconds fits a lease of
    ``ttl`` seconds (``max_kill_after``); ``flag`` names it in the message."""
    fits = max_kill_after(ttl)
    if kill_after > fits:
        raise UsageError(
            f"{flag} {kill_after:g}s does not fit a {ttl:g}s TTL: at most {fits:.2f}s "
            "(TTL - TTL/3 - margins), so that the SIGKILL lands before the lease can "
            "expire; shorten it or raise the TTL"
        )


class Outcome(enum.Enum):
    """How one round of the supervision ended."""

    CHILD_EXITED = "child-exited"  # the child ran to its end while the hold was kept
    LOST_BEFORE_START = "lost-before-start"  # nothing ran: the slot is queued for again
    LOST_WHILE_RUNNING = "lost"  # the hold was lost (or its deadline came): child killed
    SIGNAL = "signal"  # a stop signal to conch: the child was terminated
    NOT_FOUND = "child-not-found"  # the command was not found: nothing ran
    CANNOT_EXECUTE = "child-cannot-execute"  # found, but could not be executed
    WATCHDOG_FAILED = "watchdog-failed"  # no watchdog, or it died: no child, or child killed
    INTERNAL_ERROR = "internal-error"  # a bug of conch's (raised): the child is SIGKILLed


# The one table from outcomes to exit codes (contract section 8). None: the child's own
# status, as a shell reports it (128 + S for a child killed by signal S).
EXIT_CODES: dict[Outcome, int | None] = {
    Outcome.CHILD_EXITED: None,
    Outcome.SIGNAL: None,
    # Not an exit of its own: supervise() queues again, and exits 75 once --wait runs out.
    Outcome.LOST_BEFORE_START: EX_TEMPFAIL,
    Outcome.LOST_WHILE_RUNNING: EX_SOFTWARE,
    Outcome.NOT_FOUND: EX_NOT_FOUND,
    Outcome.CANNOT_EXECUTE: EX_CANNOT_EXECUTE,
    Outcome.WATCHDOG_FAILED: EX_SOFTWARE,
    Outcome.INTERNAL_ERROR: EX_SOFTWARE,
}


def exit_code(outcome: Outcome, status: int | None = None) -> int:
    """The exit code of ``outcome`` (EXIT_CODES); ``status``: the child's, where it is the
    code."""
    code = EXIT_CODES[outcome]
    if code is not None:
        return code
    assert status is not None
    return status


@dataclass(frozen=True)
class _ChildExit:
    returncode: int


_DEADLINE = object()  # a wait's result: the SIGTERM planned back from the deadline is due


# -- the supervision --------------------------------------------------------------------------


def supervise(
    sema: Semaphore,
    argv: Sequence[str],
    wait: float | None,
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Hold a slot of ``sema`` while ``argv`` runs; return the exit code (contract section 8,
    ``EXIT_CODES``).

    ``wait`` seconds for a slot (None: forever, 0: try once); ``kill_after`` seconds between
    SIGTERM and SIGKILL, planned back from the lease's earliest expiry: the child is dead
    ``deadline_margin(ttl)`` seconds before its lease can expire on the server, whether or
    not a loss has been declared (raises UsageError when ``kill_after`` does not fit
    ``sema.ttl``: ``max_kill_after``); ``stop`` set (by a signal) withdraws or terminates;
    ``environ`` is the environment the child starts from (default ``os.environ``), less
    conch's credentials. Raises NoSlot, Interrupted, Unavailable from the acquisition
    (Semaphore.acquire: Lease.LeaseGrant, KV.Txn, KV.Range, Watch); returns 70 when the
    hold was lost while the child ran, or its watchdog died. A hold lost before the child
    started (nothing ran) is given back and the slot queued for again, at the back of the
    queue, while ``wait`` allows (a ``requeue`` warning; NoSlot once it does not). What the
    child leaves in its group is reaped as it dies only after ``adopt_orphans()`` (the
    command calls it); else a zombie among them holds the slot until PID 1 reaps it or
    ``kill_after`` runs out.
    ``watchdog`` (from ``start_watchdog(kill_after)``, started before connecting so that its
    interpreter starts while the connection is made) serves the first round; it is
    dismissed like one started here. In-process, the deadline is kept by this process's
    own threads and by the watchdog process: a pause of the whole process (SIGSTOP, a VM
    paused whole) stops the former, never the latter.
    """
    check_kill_after(kill_after, sema.ttl)
    deadline = None if wait is None else time.monotonic() + wait
    backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
    while True:
        try:
            return _hold_and_run(
                sema, argv, remaining(deadline), kill_after, stop, watchdog, environ
            )
        except HoldLost as exc:
            watchdog = None  # dismissed with its round
            sema.pause_before_reentry(exc, deadline, stop, backoff)


def _hold_and_run(
    sema: Semaphore,
    argv: Sequence[str],
    wait: float | None,
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog | None,
    environ: Mapping[str, str] | None,
) -> int:
    """One round of ``supervise``: a watchdog (``watchdog`` or a new one), a hold, the child.
    Raises HoldLost when the hold was lost before the child started."""
    try:
        # before queueing: its start-up is over by the slot
        watchdog = watchdog or start_watchdog(kill_after, environ)
    except OSError as exc:
        return _report(Outcome.WATCHDOG_FAILED, error=str(exc))
    try:
        hold = sema.acquire(wait, stop, guard=False)
        hold._warn_on_loss = False  # reported below as an error, with what became of the child
        try:
            if stop.is_set():
                raise Interrupted(stop.reason)
            return run_child(hold, argv, kill_after, stop, watchdog, environ)
        finally:
            hold.release()
    finally:
        # After the release: the watchdog's exit does not compete with the next holder's
        # start, and conch does not exit before it (an outer conch, our subreaper, would
        # find it re-parented to it and stop it as a process escaped from its job).
        watchdog.close(WATCHDOG_EXIT_TIMEOUT, reap=not _adopting)


def child_env(hold: Hold, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) less conch's credentials
    (``conch.watchdog.CREDENTIALS``) and our GRPC_ENABLE_FORK_SUPPORT, plus CONCH_NAME,
    CONCH_REV (fencing token), CONCH_LEASE, CONCH_MAX."""
    env = without_credentials(os.environ if environ is None else environ)
    if etcd.FORK_SUPPORT_OFF:  # the command's setting, read when it runs
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    env.update(
        CONCH_NAME=hold.name,
        CONCH_REV=str(hold.revision),
        CONCH_LEASE=f"{hold.lease_id:x}",
        CONCH_MAX=str(hold.max),
    )
    return env


def start_watchdog(kill_after: float, environ: Mapping[str, str] | None = None) -> Watchdog:
    """A Watchdog, known to the adopting reaper as no part of any job (its process is our
    child too), started with ``environ`` (default ``os.environ``) less conch's credentials.
    Raises OSError as Watchdog does."""
    with _reap_lock:  # not reaped before it is known: its pid may come back as a job's
        watchdog = Watchdog(kill_after, environ)
        if _adopting and (stat := _stat(watchdog.pid)) is not None:
            _beside_jobs[watchdog.pid] = stat.started
    _spawned.set()
    return watchdog


def _report(outcome: Outcome, status: int | None = None, /, **fields: object) -> int:
    """Log an outcome that is an error (one ``event=`` line named for it, with ``fields``);
    return its exit code."""
    if outcome is not Outcome.CHILD_EXITED and outcome is not Outcome.SIGNAL:
        log.error(outcome.value, **fields)
    return exit_code(outcome, status)


def run_child(
    hold: Hold,
    argv: Sequence[str],
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Start ``argv`` in its own process group and wait for whichever comes first: its exit
    (return its status), the loss of ``hold`` (terminate it, return 70), the deadline (no
    keepalive confirmed in time: terminate it so that it is dead before the lease can
    expire, return 70), its watchdog's death (terminate it, return 70), or ``stop``
    (terminate it, return its status). Never starts it without a hold: raises HoldLost if
    it is lost (or its lease not certainly alive long enough) before the child starts,
    Interrupted if ``stop`` is set before it starts.
    ``hold`` is released as soon as the child has exited with nothing left in its group
    and, after ``adopt_orphans()``, nothing left outside it either: what the child started
    and left in the background counts as the child until it is gone (a ``stragglers`` or an
    ``escaped`` warning, then SIGTERM, SIGKILL ``kill_after`` later), and is terminated
    with the child's group on a loss or ``stop``.
    ``watchdog`` (started in advance) is armed with the child's group; without one, one is
    started here, before the child."""
    try:
        watchdog = watchdog or start_watchdog(kill_after, environ)
    except OSError as exc:
        return _report(Outcome.WATCHDOG_FAILED, error=str(exc))
    run = _Run(hold, kill_after, stop, watchdog)
    if not watchdog.ready(WATCHDOG_START_TIMEOUT, stop):  # long since, unless the slot was free
        watchdog.dismiss()
        if stop.is_set():
            raise Interrupted(stop.reason)
        return _report(
            Outcome.WATCHDOG_FAILED, error=f"not running after {WATCHDOG_START_TIMEOUT:g}s"
        )
    # After the watchdog's start, which can take a while on a loaded machine.
    run.confirm_hold()
    env = child_env(hold, environ)
    try:
        # Before the child exists: a conch killed before the arm line below leaves it found.
        watchdog.expect({mark: env[mark] for mark in _MARKS}, run.margin, run.expiry())
    except OSError as exc:
        watchdog.dismiss()
        return _report(Outcome.WATCHDOG_FAILED, error=str(exc))
    with _reap_lock:  # the adopting reaper takes no status until the child is claimed
        try:
            pid = spawn(argv, env)
        except (FileNotFoundError, ValueError):  # ValueError: an empty command name
            watchdog.dismiss()
            return _report(Outcome.NOT_FOUND, cmd=argv[0], **hints.not_found(argv[0]))
        except OSError as exc:
            watchdog.dismiss()
            return _report(Outcome.CANNOT_EXECUTE, cmd=argv[0], error=exc.strerror or str(exc))
        try:
            try:
                watchdog.arm(pid)
                unarmed = None
            except OSError as exc:
                unarmed = exc
            box = run.box
            _on_exit(pid, lambda status: _child_exited(pid, status, box))
        except BaseException:  # no reaping thread (can't start new thread): fail closed
            _kill_group(pid)
            raise
    try:  # from here on, whatever goes wrong, the child does not outlive our supervision
        if unarmed is not None:
            run.terminate(_Job(pid), child_running=True, kill_at=run.kill_at_latest())
            return _report(Outcome.WATCHDOG_FAILED, error=str(unarmed))
        return run.supervise(pid)
    except BaseException:
        # Fail closed: an error of ours (a bug, MemoryError) must not leave the child
        # running with nobody watching it while the slot is released.
        _kill_group(pid)
        raise
    finally:
        run.finish()


class _Run:
    """One child's supervision, from its spawn to its end: the hold, the stop flag, the
    watchdog, the mailbox every one of them (and the reaper) reports into, and the
    deadline planned back from the lease's earliest expiry."""

    def __init__(self, hold: Hold, kill_after: float, stop: Flag, watchdog: Watchdog) -> None:
        ttl = hold.session.ttl  # as granted: etcd may raise it, never lower it
        self.hold = hold
        self.stop = stop
        self.watchdog = watchdog
        self.margin = deadline_margin(ttl)
        self.kill_after = min(kill_after, max_kill_after(ttl))
        self.box: Mailbox = queue.SimpleQueue()
        self._undo: list[Callable[[], None]] = []

    def expiry(self) -> float:
        """The lease's earliest expiry on the server, ``time.monotonic()``."""
        return self.hold.session.alive_until

    def kill_at_latest(self) -> float:
        """The instant (``time.monotonic()``) by which the child must be dead."""
        return self.expiry() - self.margin

    def term_at(self) -> float:
        """The SIGTERM planned back from the deadline: ``kill_after`` before it."""
        return self.kill_at_latest() - self.kill_after

    def grace_until(self) -> float:
        """SIGKILL's instant for a termination that starts now: ``kill_after`` from now, or
        the deadline if that comes first."""
        return min(time.monotonic() + self.kill_after, self.kill_at_latest())

    def confirm_hold(self) -> None:
        """Raise Interrupted if ``stop`` is set, HoldLost unless the hold is ours with time
        to spare: not lost, and the deadline's SIGTERM not due yet (a process stalled since
        its last keepalive, or a keepalive overdue: the child would be stopped at once)."""
        if self.stop.is_set():
            self.watchdog.dismiss()
            raise Interrupted(self.stop.reason)
        if self.hold.lost.is_set() or time.monotonic() >= self.term_at():
            self.watchdog.dismiss()
            reason = self.hold.lost.reason or "lease not confirmed alive (process stalled?)"
            raise HoldLost(f"hold lost before the child started: {reason}")

    def supervise(self, pid: int) -> int:
        """From the child's start to its end: wait for the first notice, act on it, return
        the exit code."""
        hold, watchdog = self.hold, self.watchdog
        hold.start_guard()
        started = time.monotonic()
        log.info("child-start", pid=pid, rev=hold.revision)
        # After the spawn, off the handoff's path (a thread's start): a watchdog that died
        # before is seen all the same, its stdout's end waiting to be read.
        watchdog.watch(self.box)
        self._undo.append(hold.session.on_keepalive(lambda: watchdog.heartbeat(self.expiry())))
        # A keepalive confirmed since the expect line, before the listener above, would be
        # missing from the watchdog's expiry: it could fire an interval early.
        watchdog.heartbeat(self.expiry())
        hold.lost.subscribe(self.box)
        self.stop.subscribe(self.box)
        self._undo += [
            lambda: hold.lost.unsubscribe(self.box),
            lambda: self.stop.unsubscribe(self.box),
        ]
        notice = self._first_notice()
        job = _Job(pid)
        if isinstance(notice, _ChildExit):
            if not job.alive():
                # The next holder waits for this revoke: it goes before anything else.
                hold.release(log_it=False)
            code = _log_child_exit(pid, notice.returncode, started)
            if job.alive():  # a warning for each process that escaped the group
                if _group_alive(pid):
                    log.warning("stragglers", pgid=pid)
                self.terminate(job, child_running=False, kill_at=self.grace_until())
            watchdog.dismiss()
            if watchdog.fired:  # we were frozen past the deadline; the watchdog stopped it
                return self._lost(STALLED)
            return exit_code(Outcome.CHILD_EXITED, code)
        if notice is self.stop:
            log.info("signal", signum=self.stop.reason, pid=pid)
            returncode = self.terminate(job, child_running=True, kill_at=self.grace_until())
            return exit_code(Outcome.SIGNAL, _log_child_exit(pid, returncode, started))
        if isinstance(notice, WatchdogExited) and not notice.fired:
            # No grace: with the watchdog gone nothing else holds the deadline, and a conch
            # frozen during a grace (found by the overlap harness: the wrapper stopped half a
            # second after its watchdog's death) would leave the child running beside the
            # next holder. SIGKILL at once.
            returncode = self.terminate(job, child_running=True, kill_at=time.monotonic())
            _log_child_exit(pid, returncode, started)
            return _report(Outcome.WATCHDOG_FAILED, error="the watchdog exited while the child ran")
        reason = self._loss_reason(notice)
        log.error("lost", name=hold.name, rev=hold.revision, reason=reason)
        if notice is hold.lost and _slot_taken(hold):
            # Our key is gone in etcd itself: the slot may be someone else's already, so
            # a grace could only be spent beside its new holder. SIGKILL at once.
            kill_at = time.monotonic()
        elif notice is _DEADLINE:
            kill_at = self.kill_at_latest()
        else:
            kill_at = self.grace_until()
        returncode = self.terminate(job, child_running=True, kill_at=kill_at)
        _log_child_exit(pid, returncode, started)
        return exit_code(Outcome.LOST_WHILE_RUNNING)

    def _first_notice(self) -> object:
        """The first of: the child's exit (a _ChildExit), the hold's loss or ``stop`` (the
        Flag), the watchdog's end (a WatchdogExited), or _DEADLINE when the SIGTERM planned
        back from the lease's earliest expiry is due (no keepalive confirmed in time: the
        expiry is read again at each wake, as keepalives move it on)."""
        while True:
            try:
                return self.box.get(timeout=remaining(self.term_at()))
            except queue.Empty:
                if time.monotonic() >= self.term_at():
                    return _DEADLINE

    def _loss_reason(self, notice: object) -> str:
        if self.watchdog.fired:
            return STALLED
        if notice is _DEADLINE:
            left = self.expiry() - time.monotonic()
            return (
                f"no keepalive confirmed in time: the lease can expire in {left:.2f}s; "
                "the child is stopped before that"
            )
        return str(self.hold.lost.reason)

    def _lost(self, reason: str) -> int:
        log.error("lost", name=self.hold.name, rev=self.hold.revision, reason=reason)
        return exit_code(Outcome.LOST_WHILE_RUNNING)

    def terminate(self, job: _Job, child_running: bool, kill_at: float) -> int | None:
        """Stop ``job``: SIGTERM now, SIGKILL at ``kill_at`` (``time.monotonic()``; at once if
        that has passed), sooner if our key is seen gone meanwhile. The watchdog stands by:
        counting to the deadline it would only send a second SIGTERM into the child's
        cleanup, but should conch die meanwhile (SIGKILL, OOM) it still finishes the
        termination. Returns the child's return code (if ``child_running``)."""
        self.watchdog.stand_by(kill_at)
        return _stop_group(job, self.box, child_running, kill_at, self._hurry)

    def _hurry(self, notice: object) -> bool:
        """Whether ``notice``, come during a termination, calls for SIGKILL now."""
        return notice is self.hold.lost and _slot_taken(self.hold)

    def finish(self) -> None:
        for undo in self._undo:
            undo()
        self.watchdog.dismiss()


STALLED = "wrapper stalled; the watchdog terminated the child"


def _slot_taken(hold: Hold) -> bool:
    """Whether the hold's loss was seen in etcd itself: our key deleted while the session
    lives (the guard's watch, a guarded write), or our lease unknown to etcd (revoked, or
    expired). Not an unanswered keepalive: the lease then lives until its expiry. Decided
    by the loss's LossReason (``LossReason.slot_taken``), never by its message."""
    reason = Loss.of(hold.lost.reason)
    return reason is not None and reason.slot_taken


def _log_child_exit(pid: int, returncode: int | None, started: float) -> int:
    """Log ``child-exit`` (the child's status as a shell reports it, and how long it ran);
    return that status. ``None``: not reaped even after SIGKILL (stuck in the kernel),
    reported as killed by SIGKILL."""
    if returncode is None:
        log.warning("child-unreaped", pid=pid, after=f"{REAP_AFTER_KILL:g}s")
        returncode = -signal.SIGKILL
    code = exit_status(returncode)
    log.info("child-exit", pid=pid, code=code, ran=f"{time.monotonic() - started:.3f}s")
    return code


# -- signals ---------------------------------------------------------------------------------


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: the code, or 128 + S if killed by signal S."""
    return returncode if returncode >= 0 else 128 - returncode


@contextlib.contextmanager
def stop_on_signals(stop: Flag, restore: bool = True) -> Iterator[Flag]:
    """While inside, every signal of STOP_SIGNALS (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1,
    SIGUSR2, SIGALRM, ..., the real-time signals) sets ``stop`` (reason: the signal number)
    instead of killing us, and SIGTSTP (^Z) is refused (a warning the first time): a stopped conch
    sends no keepalives, so its child would run on unsupervised until the watchdog or the
    lease's expiry ended the hold. Any of them but SIGTERM ignored on entry stays ignored,
    here and in the child (``posix_spawn`` keeps what is ignored): whoever started us said it
    must not stop us (``nohup``, a script's background job, which ignores SIGINT). Process-wide
    signal handlers: for the command, or a caller that owns the process's signals. The
    previous handlers come back on leaving, unless ``restore`` is False (a process about to
    exit with its child's status: a late signal must not turn that into death by the
    signal)."""
    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGTSTP)}
    for sig, handler in previous.items():
        if handler == signal.SIG_IGN and sig in KEEP_IGNORED:
            continue
        if sig == signal.SIGTSTP:
            signal.signal(sig, _refuse_suspend)
        else:
            signal.signal(sig, lambda signum, frame: stop.set(signum))
    try:
        yield stop
    finally:
        if restore:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_suspend_refused = False  # the warning is written once: a storm of ^Z must not nest handlers


def _refuse_suspend(signum: int, frame: object) -> None:
    global _suspend_refused
    if _suspend_refused:
        return
    _suspend_refused = True
    log.warning_from_signal_handler(
        "suspend-refused",
        signum=signum,
        reason="a stopped conch cannot keep its lease; stop the job with ^C or SIGTERM",
    )


# -- the spawn -------------------------------------------------------------------------------

# Signals to reset to their default in the child: an ignored signal stays ignored across exec,
# and Python starts with these ignored (a child would see EPIPE where a shell's pipelines
# expect to die by SIGPIPE). glibc's posix_spawn also leaves its two reserved signals (32, 33,
# below SIGRTMIN, unusable by programs) ignored in the child; nothing can reset those.
_RESET_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ", "SIGXFZ", "SIGCHLD") if hasattr(signal, n)
)


def _inherited_fds() -> list[int]:
    """Our inheritable descriptors above stderr (Python's own are never inheritable)."""
    fds = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if int(name) > 2 and os.get_inheritable(int(name)):
                    fds.append(int(name))
    return fds


def spawn(argv: Sequence[str], env: dict[str, str]) -> int:
    """Start ``argv`` (searched on PATH) in a new session and process group, with stdin,
    stdout and stderr only (as ``subprocess``'s ``close_fds``); return its pid. One
    ``posix_spawn``: the cheapest way to start a process from a large one, and it reports a
    failed exec (FileNotFoundError, PermissionError, other OSError). A file the kernel
    cannot execute (ENOEXEC: a script without a ``#!`` line) is run by /bin/sh, as
    ``execvp(3)``, and so ``flock(1)``, do."""
    closes = [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inherited_fds()]

    def start(path: str, args: list[str], search: bool = False) -> int:
        launch = os.posix_spawnp if search else os.posix_spawn
        return launch(
            path,
            args,
            env,
            file_actions=closes,
            setsid=True,
            setsigmask=(),  # nothing blocked
            setsigdef=_RESET_SIGNALS,  # as subprocess's restore_signals
        )

    try:
        return start(argv[0], list(argv), search=True)
    except OSError as exc:
        if exc.errno != errno.ENOEXEC:
            raise
    # Search again, the way execvp(3) does, and give the file that says ENOEXEC to the shell
    # (an earlier one on PATH may have been skipped: ENOENT from a missing #! interpreter).
    denied = False
    for path in _candidates(argv[0]):
        try:
            return start(path, list(argv))
        except OSError as exc:
            if exc.errno == errno.ENOEXEC:
                return start(SHELL, [SHELL, path, *argv[1:]])
            if exc.errno not in _SEARCH_ON:
                raise
            denied = denied or exc.errno == errno.EACCES
    if denied:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), argv[0])
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])


# Errors on one PATH entry after which execvp(3) tries the next one.
_SEARCH_ON = {
    errno.EACCES,
    errno.ENOENT,
    errno.ESTALE,
    errno.ENOTDIR,
    errno.ENODEV,
    errno.ETIMEDOUT,
}


def _candidates(name: str) -> list[str]:
    """The paths execvp(3) tries for ``name``, in order (an empty PATH entry is the current
    directory)."""
    if "/" in name:
        return [name]
    return [os.path.join(entry, name) for entry in os.environ.get("PATH", os.defpath).split(":")]


# -- the reaper ------------------------------------------------------------------------------


def adopt_orphans() -> bool:
    """Make this process a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``) and start
    one thread that reaps every child it has: what a supervised child leaves behind is
    re-parented to us instead of PID 1, and reaped the moment it dies. Without it, a process
    of the child's group that died of our SIGTERM is a zombie until PID 1 reaps it (late
    where PID 1 is slow, never where it does not reap), and a zombie still counts as a
    member of the group: the slot stays held until ``kill_after`` runs out. Process-wide:
    only for a process that waits for no children of its own (the ``conch`` command); the
    statuses of children ``run_child`` did not start are dropped, and SIGCHLD is set back to
    its default if ignored (the kernel would reap them itself). Idempotent. Returns whether
    it worked."""
    global _adopting
    with _reap_lock:
        if _adopting:
            return True
        if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            except ValueError:  # not the main thread: waitpid() per child copes
                return False
        try:
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl
            _adopting = prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            _adopting = False
        if _adopting:
            threading.Thread(target=_reap_all, name="conch-reap", daemon=True).start()
        return _adopting


def _on_exit(pid: int, callback: Callable[[int], None]) -> None:
    """Call ``callback(wait_status)`` from a reaping thread once our child ``pid`` exits: the
    process-wide one after ``adopt_orphans()`` (call with ``_reap_lock`` held since before
    the child existed), else a thread of its own blocked in waitpid on that pid alone."""
    if _adopting:
        _claimed[pid] = callback
        _spawned.set()
        return

    def wait() -> None:
        try:
            _, status = os.waitpid(pid, 0)  # retried by Python on EINTR (PEP 475)
        except ChildProcessError:
            # Reaped by the kernel (SIGCHLD ignored) or by someone else's waitpid: the
            # child is gone and its status lost. 0, as subprocess reports it then.
            log.warning("child-status-lost", pid=pid)
            status = 0
        _call_back(callback, status)

    threading.Thread(target=wait, name="conch-reap", daemon=True).start()


def _reap_all() -> None:
    """The adopting reaper: reap each child as it exits, and every other one that has exited
    by then too (what died with a supervised child is no member of its group any more when
    its callback looks), then call the callbacks of the claimed ones. With no child at all,
    look again when we start a process, or after GROUP_POLL seconds: an orphan may yet come."""
    while True:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # wait, reap nothing yet
        except ChildProcessError:
            # A start after the waitid above sets it; one before is seen by the next waitid.
            _spawned.wait(GROUP_POLL)
            _spawned.clear()
            continue
        done: list[tuple[Callable[[int], None], int]] = []
        with _reap_lock:
            while True:
                try:
                    reaped, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if reaped == 0:
                    break
                _beside_jobs.pop(reaped, None)
                callback = _claimed.pop(reaped, None)
                if callback is not None:
                    done.append((callback, status))
        for callback, status in done:
            _call_back(callback, status)


def _call_back(callback: Callable[[int], None], status: int) -> None:
    """Run a child's exit callback; one that raises is logged, and the reaper reaps on."""
    try:
        callback(status)
    except Exception as exc:
        log.error("callback-failed", flag="child-exit", error=repr(exc))


def _child_exited(pid: int, status: int, box: Mailbox) -> None:
    """From the reaping thread: tell the supervisor, which releases the hold the moment it
    finds the child's group gone (a thread switch later: the reaper makes no call to etcd,
    so that a slow etcd never holds up the reaping of other children)."""
    box.put(_ChildExit(os.waitstatus_to_exitcode(status)))


# -- /proc -----------------------------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _orphans() -> dict[int, _Stat]:
    """What jobs left outside their process groups: our children that conch did not start
    (re-parented to us, their subreaper, as their parents died). Zombies count: they are
    reaped a moment later. Empty unless ``adopt_orphans()`` worked (without it they go to
    another reaper, out of our sight)."""
    if not _adopting:
        return {}
    # No reaping meanwhile: a descendant is re-parented to us only as its parent dies, and
    # that parent (or an ancestor of it) is then a child of ours, in view until reaped.
    with _reap_lock:
        return {
            pid: stat
            for pid, stat in _children().items()
            if pid not in _claimed and _beside_jobs.get(pid) != stat.started
        }


_PER_THREAD_CHILDREN = "/proc/self/task/{}/children"  # Linux with CONFIG_PROC_CHILDREN
_children_files: bool | None = None  # whether this kernel has them; None: not looked yet


def _children() -> dict[int, _Stat]:
    """Our children, zombies included. Read from each of our threads'
    ``children`` file where the kernel has them (a read per thread, a few more per child),
    else from every /proc/PID/stat on the machine (about 20 µs a process: 3 ms for 150,
    measured on a 2-core VM)."""
    global _children_files
    if _children_files is None:
        _children_files = os.path.exists(_PER_THREAD_CHILDREN.format(threading.get_native_id()))
    if _children_files:
        for _ in range(3):
            pids = _children_of_threads()
            if pids is not None:
                return {pid: stat for pid in pids if (stat := _stat(pid)) is not None}
    me, found = os.getpid(), {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat.ppid == me:
            found[int(name)] = stat
    return found


def _children_of_threads() -> set[int] | None:
    """The pids in our threads' ``children`` files; None if a thread ended meanwhile (its
    children moved to another thread, perhaps one already read)."""
    found: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            found.update(int(pid) for pid in _read(_PER_THREAD_CHILDREN.format(tid)).split())
        except FileNotFoundError:
            return None
    return found


def _read(path: str) -> bytes:
    """A /proc file's content (os calls: a third of the cost of ``open()`` here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _Stat(NamedTuple):
    """What /proc/PID/stat says of a process."""

    ppid: int
    pgid: int
    zombie: bool
    started: int  # clock ticks after boot


def _stat(pid: int) -> _Stat | None:
    """/proc/``pid``/stat; None once the process is gone."""
    try:
        fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
        return _Stat(int(fields[1]), int(fields[2]), fields[0] == b"Z", int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _command_line(pid: int) -> str:
    """What ``ps`` shows for ``pid``: its arguments, else (a zombie) its name in brackets."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            text = cmdline.read(256).replace(b"\0", b" ").strip()
        if text:
            return text.decode(errors="replace")
        with open(f"/proc/{pid}/comm", "rb") as comm:
            return f"[{comm.read().strip().decode(errors='replace')}]"
    return "?"


# -- the job and its termination --------------------------------------------------------------


class _Job:
    """The child's process group ``pgid`` and what the child left outside it, re-parented
    to us (``setsid cmd &``, a daemon's double fork): the slot is ours until all of it is
    gone. Each process that escaped is named once in an ``escaped`` warning, and gets what
    the group was last sent, also when it reaches us after that (its parent died of it)."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self._known: set[int] = set()
        self._sent: int | None = None

    def alive(self) -> bool:
        """Whether anything of the job is left: a member of the group, or an escaped process
        (new ones are logged, and sent the last signal)."""
        orphans = self._escaped()
        return _group_alive(self.pgid) or bool(orphans)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the group and to every process that escaped it (the whole group of
        one that leads a group of its own: what it started in turn)."""
        self._sent = sig
        _signal_group(self.pgid, sig)
        for pid, stat in self._escaped().items():
            _signal_escaped(pid, stat.pgid, sig)

    def _escaped(self) -> dict[int, _Stat]:
        orphans = _orphans()
        for pid, stat in orphans.items():
            # In the group: signalled with it. A zombie: gone, but for its reaping.
            if stat.pgid == self.pgid or stat.zombie or pid in self._known:
                continue
            self._known.add(pid)
            log.warning("escaped", pgid=self.pgid, pid=pid, cmd=_command_line(pid))
            if self._sent is not None:
                _signal_escaped(pid, stat.pgid, self._sent)
        return orphans


def _signal_escaped(pid: int, pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if pgid == pid:
            # It leads a group, in a session of its own or the child's: only processes
            # of the job can be in it, what it started in turn.
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _kill_group(pgid: int) -> None:
    """SIGKILL the group and what escaped it, and give them a moment (GONE_AFTER_KILL) to
    be gone; never raises (it runs on the way out of an error, which must stay the one
    reported)."""
    with contextlib.suppress(Exception):
        job = _Job(pgid)
        job.signal(signal.SIGKILL)
        _await_gone(job, time.monotonic() + GONE_AFTER_KILL)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _stop_group(
    job: _Job,
    box: Mailbox,
    child_running: bool,
    kill_at: float,
    hurry: Callable[[object], bool] | None = None,
) -> int | None:
    """SIGTERM the job (its group and what escaped it); SIGKILL whatever is left of it at
    ``kill_at`` (``time.monotonic()``): at once, without SIGTERM, if that has passed, and
    as soon as a notice comes for which ``hurry(notice)`` is true. Waits for the child (if
    ``child_running``) to be reaped; returns its return code."""
    returncode = None if child_running else 0
    if time.monotonic() < kill_at:
        job.signal(signal.SIGTERM)
        log.info("term-sent", pgid=job.pgid)
        returncode, kill_at = _await_exit(box, kill_at, returncode, hurry)
        _await_gone(job, kill_at)
    if returncode is None or job.alive():
        job.signal(signal.SIGKILL)
        log.warning("kill-sent", pgid=job.pgid)
        returncode, _ = _await_exit(box, time.monotonic() + REAP_AFTER_KILL, returncode)
        # A SIGKILLed process is still running its exit (closing files, dropping locks,
        # freeing memory): the slot stays ours until it is gone, within a bound.
        _await_gone(job, time.monotonic() + GONE_AFTER_KILL)
    return returncode if child_running else None


def _await_gone(job: _Job, deadline: float) -> None:
    """Poll until nothing of ``job`` is left or ``deadline`` passes (grandchildren are not
    ours to wait() on)."""
    while job.alive() and time.monotonic() < deadline:
        time.sleep(min(GROUP_POLL, max(0.0, deadline - time.monotonic())))


def _await_exit(
    box: Mailbox,
    deadline: float,
    returncode: int | None,
    hurry: Callable[[object], bool] | None = None,
) -> tuple[int | None, float]:
    """Wait for the child's exit notice until ``deadline``; other notices are dropped, but
    one for which ``hurry(notice)`` is true ends the wait at once. Returns the return code
    (None: not reaped in time) and the deadline (now, if hurried)."""
    while returncode is None:
        try:
            item = box.get(timeout=remaining(deadline))
        except queue.Empty:
            break
        if isinstance(item, _ChildExit):
            return item.returncode, deadline
        if hurry is not None and hurry(item):
            return None, time.monotonic()
    return returncode, deadline
