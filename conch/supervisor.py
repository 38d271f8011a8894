"""The supervision loop (contract section 7; docs/design.md, "The supervision loop"):
acquire, run the child, child exit or loss, terminate, release, once for the CLI and embedders
(``supervise``); every way a round ends is an ``Outcome`` (``conch.errors.EXIT_CODES``). The
child is SIGKILLed by E - ``deadline_margin(ttl)`` (E: the lease's earliest expiry,
``Session.alive_until``, on our monotonic clock) and SIGTERMed ``kill_after`` before, a loss
declared or not, so that no waiter takes the slot while it runs; the watchdog process holds the
same deadline for a wrapper frozen (SIGSTOP, a VM paused) or dead. The POSIX plumbing under it
is ``conch.procs``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

from conch import etcd, hints, log, procs
from conch.core.loss import Loss
from conch.core.session import keepalive_margin
from conch.errors import HoldLost, Interrupted, Outcome, UsageError, exit_code, exit_status
from conch.etcd.client import Backoff
from conch.flag import Flag, Mailbox, remaining
from conch.hold import Hold
from conch.procs import ChildExit, _Job, _on_exit, adopt_orphans, spawn
from conch.semaphore import REENTRY_BACKOFF_CAP, Semaphore
from conch.watchdog import Watchdog, WatchdogNotice, without_credentials

__all__ = ["adopt_orphans", "run_child", "spawn", "stop_on_signals", "supervise"]

# The catchable signals whose default ends the process, sent to ask it to stop: each stops
# conch as SIGTERM does. Not a fault's (SIGSEGV, ...), nor SIGPIPE, SIGXFSZ (docs/design.md).
_STOPPING = "HUP INT QUIT USR1 USR2 ALRM TERM STKFLT XCPU VTALRM PROF IO PWR"
STOP_SIGNALS: tuple[int, ...] = (
    *(getattr(signal, f"SIG{name}") for name in _STOPPING.split() if hasattr(signal, f"SIG{name}")),
    *(range(signal.SIGRTMIN, signal.SIGRTMAX + 1) if hasattr(signal, "SIGRTMIN") else ()),
)
# Signals that stay ignored if they are when we start (nohup's SIGHUP; a background job's
# SIGINT and SIGQUIT). Not SIGTERM: it is how conch, and its watchdog, stop the child.
KEEP_IGNORED = (*(sig for sig in STOP_SIGNALS if sig != signal.SIGTERM), signal.SIGTSTP)
WATCHDOG_START_TIMEOUT = 10.0  # seconds for the watchdog to say it runs, before the child
WATCHDOG_EXIT_TIMEOUT = 1.0  # seconds to wait for a dismissed watchdog to be gone
RELEASE_AFTER_LOSS = 0.25  # seconds the release after a loss is given at most, never past E
STALLED = "wrapper stalled; the watchdog terminated the child"
_DEADLINE = object()  # a wait's result: the SIGTERM planned back from the deadline is due
DEADLINE_MARGIN = 0.25  # seconds (deadline_margin): a late wake-up, the SIGKILL's delivery
CLOCK_RATE_TOLERANCE = 0.001  # of the TTL: how much faster etcd's leader's clock may run


def deadline_margin(ttl: float) -> float:
    """Seconds before the lease's earliest expiry (TTL ``ttl`` seconds) by which the child
    must be dead: DEADLINE_MARGIN + CLOCK_RATE_TOLERANCE * ``ttl``."""
    return DEADLINE_MARGIN + CLOCK_RATE_TOLERANCE * ttl


def max_kill_after(ttl: float) -> float:
    """The longest grace (seconds between SIGTERM and SIGKILL) that fits a lease of ``ttl``
    seconds: ``ttl`` less one keepalive interval (TTL/3), the keepalive margin and the
    deadline margin, so that the SIGTERM planned back from E never comes before the next
    keepalive could be answered. 1.25 s for a TTL of 3 s, 5.4 s for 10 s, 12 s for 20 s."""
    return max(0.0, ttl - ttl / 3 - keepalive_margin(ttl) - deadline_margin(ttl))


def default_kill_after(ttl: float, asked: float = 5.0) -> float:
    """The grace (seconds) conch gives when none is asked for: ``asked`` (the documented 5 s),
    or less where the TTL cannot give that and still leave the keepalive after the last
    confirmed one its whole patience (an interval plus the keepalive margin) before the
    SIGTERM planned back from E. 0.25 s at a TTL of 3 s, 2.07 s at 10 s, 5 s from 19 s up."""
    return max(0.0, min(asked, ttl / 3 - keepalive_margin(ttl) - deadline_margin(ttl)))


def check_kill_after(kill_after: float, ttl: float, flag: str = "kill_after") -> float:
    """The grace to give (seconds): ``kill_after``, cut to ``max_kill_after(ttl)``. Raises
    UsageError (exit 64), naming ``flag``, unless ``kill_after`` fits a lease of ``ttl``
    seconds as the limit is shown, to the hundredth of a second (1.2467 s is accepted as
    1.25 s; the cut comes off the SIGTERM's side)."""
    fits = max_kill_after(ttl)
    shown = f"{fits:.2f}"
    if kill_after > float(shown) + 1e-9:  # 1e-9: 5410ms parses as 5.410000000000001
        raise UsageError(  # as asked, never rounded like the limit beside it
            f"{flag} {kill_after:.9g}s does not fit a {ttl:g}s TTL: at most {shown}s "
            "(TTL - TTL/3 - margins), so that the SIGKILL lands before the lease can "
            "expire; shorten it or raise the TTL"
        )
    return min(kill_after, fits)


def supervise(
    sema: Semaphore,
    argv: Sequence[str],
    wait: float | None,
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Hold a slot of ``sema`` while ``argv`` runs (``run_child``); return the exit code
    (README.md, "Exit codes"; ``EXIT_CODES``).

    ``wait`` seconds for a slot (None: forever, 0: try once); ``kill_after`` seconds between
    SIGTERM and SIGKILL, planned back from the lease's earliest expiry (UsageError when it
    does not fit ``sema.ttl``: ``max_kill_after``); ``stop`` set (by a signal) withdraws or
    terminates; ``environ`` as for ``run_child``; ``watchdog`` (``start_watchdog()``, started
    before connecting) serves the first round. Raises NoSlot, Interrupted, Unavailable from
    the acquisition (Semaphore.acquire: Lease.LeaseGrant, KV.Txn, KV.Range, Watch). A hold
    lost before the child started is given back and queued for again, at the back, while
    ``wait`` allows (a ``requeue`` warning; NoSlot once it does not)."""
    kill_after = check_kill_after(kill_after, sema.ttl)
    deadline = None if wait is None else time.monotonic() + wait
    backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
    while True:  # a round: a watchdog, a hold, the child
        try:  # the watchdog before queueing: its start-up is over by the slot
            watchdog = watchdog or start_watchdog(None, environ)
        except OSError as exc:
            return _report(Outcome.WATCHDOG_FAILED, error=str(exc))
        try:
            hold = sema.acquire(remaining(deadline), stop, guard=False)
            hold._warn_on_loss = False  # reported below as an error, with what became of the child
            try:  # Interrupted if ``stop`` is set (by now, or during the handshake)
                return run_child(hold, argv, kill_after, stop, watchdog, environ)
            finally:
                hold.release()
        except HoldLost as exc:  # before the child started: queued for again
            lost = exc
        finally:
            # After the release (the next holder's start comes first), and before conch exits
            # (an outer conch, our subreaper, would stop it as a process escaped its job).
            watchdog.close(WATCHDOG_EXIT_TIMEOUT, reap=not procs._adopting)
        watchdog = None  # dismissed with its round
        sema.pause_before_reentry(lost, deadline, stop, backoff)


def child_env(hold: Hold, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) less conch's credentials
    (``conch.watchdog.CREDENTIAL_VARIABLES``) and our GRPC_ENABLE_FORK_SUPPORT, plus
    CONCH_NAME, CONCH_REV (fencing token), CONCH_LEASE, CONCH_MAX."""
    env = without_credentials(os.environ if environ is None else environ)
    if etcd.FORK_SUPPORT_OFF:  # the command's setting, read when it runs
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    env.update(CONCH_NAME=hold.name, CONCH_REV=str(hold.revision))
    env.update(CONCH_LEASE=f"{hold.lease_id:x}", CONCH_MAX=str(hold.max))
    return env


def start_watchdog(watchdog: Watchdog | None, environ: Mapping[str, str] | None) -> Watchdog:
    """``watchdog`` (started before ``adopt_orphans()``), else a new Watchdog (``environ``: as
    Watchdog's; OSError as it raises), known to the adopting reaper as no part of any job
    (its process is our child too)."""
    with procs._reap_lock:  # not reaped before it is known: its pid may come back as a job's
        watchdog = watchdog or Watchdog(environ)
        if procs._adopting and (stat := procs._stat(watchdog.pid)) is not None:
            procs._beside_jobs[watchdog.pid] = stat.started  # no job's: reaped, not "escaped"
        procs._spawned.set()  # the idle reaper looks again at once
    return watchdog


def _report(outcome: Outcome, **fields: object) -> int:  # an error's line; its exit code
    log.error(outcome.value, **fields)
    return exit_code(outcome)


def run_child(
    hold: Hold,
    argv: Sequence[str],
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Start ``argv`` in its own process group (environment: ``child_env(hold, environ)``)
    and wait for the first of: its exit (return its status), the loss of ``hold``, the
    deadline, its watchdog's death or silence (terminate it so that it is dead before the
    lease can expire, return 70), ``stop`` (terminate it, return its status). Returns 127 or
    126 when ``argv`` cannot be found or executed, 70 when the watchdog does not run or
    cannot (nothing started). Raises HoldLost if the hold is lost (or its lease not
    certainly alive long enough), Interrupted if ``stop`` is set, before the child starts.
    ``hold`` is released once nothing of the child is left in its group or, after
    ``adopt_orphans()``, outside it: what it left behind (a ``stragglers`` or ``escaped``
    warning) gets SIGTERM, SIGKILL ``kill_after`` later (on a loss or ``stop``, with the
    child's group). ``watchdog``: ``start_watchdog()``'s, started in advance."""
    run = _Run(hold, kill_after, stop, watchdog)
    try:  # every way out dismisses the watchdog (run.finish)
        error = watchdog.handshake(WATCHDOG_START_TIMEOUT, stop)
        if error is not None:
            return _report(Outcome.WATCHDOG_FAILED, error=error)
        # After the watchdog's start (seconds, under load): the hold must be ours with time to
        # spare (not a process stalled since its last keepalive, nor a keepalive overdue).
        run.confirm_lease()
        if stop.is_set():
            raise Interrupted(stop.reason)
        if hold.lost.is_set() or time.monotonic() >= run.term_at():
            reason = hold.lost.reason or "lease not confirmed alive (process stalled?)"
            raise HoldLost(f"hold lost before the child started: {reason}")
        env = child_env(hold, environ)
        try:
            # Before the child exists: a conch killed before the arm line leaves it found.
            watchdog.expect(env, run.margin, run.expiry(), run.kill_after)
        except OSError as exc:
            return _report(Outcome.WATCHDOG_FAILED, error=str(exc))
        # After the expect line (an h before it dismisses it); the arm line covers one before.
        run._undo.append(hold.session.on_keepalive(lambda: watchdog.heartbeat(run.expiry())))
        with procs._reap_lock:  # the adopting reaper takes no status until the child is claimed
            try:
                pid = spawn(argv, env)
            except (FileNotFoundError, ValueError):  # ValueError: an empty command name
                return _report(Outcome.NOT_FOUND, cmd=argv[0], **hints.not_found(argv[0]))
            except OSError as exc:
                return _report(Outcome.CANNOT_EXECUTE, cmd=argv[0], error=exc.strerror or str(exc))
            try:
                try:
                    watchdog.arm(pid, run.expiry())
                    unarmed = None
                except OSError as exc:
                    unarmed = exc
                box = run.box
                _on_exit(pid, lambda status: box.put(ChildExit(os.waitstatus_to_exitcode(status))))
            except BaseException:  # no reaping thread (can't start new thread): fail closed
                _Job(pid, run.box).kill()
                raise
        try:  # from here on, whatever goes wrong, the child does not outlive our supervision
            if unarmed is not None:
                run.terminate(_Job(pid, run.box), child_running=True, kill_at=run.kill_at_latest())
                return _report(Outcome.WATCHDOG_FAILED, error=str(unarmed))
            return run.supervise(pid)
        except BaseException:
            # Fail closed: an error of ours (a bug, MemoryError) must not leave the child unwatched.
            _Job(pid, run.box).kill()
            raise
    finally:
        run.finish()


class _Run:
    """One child's supervision: the hold, the stop flag, the watchdog, the mailbox they (and
    the reaper) report into, and the deadline planned back from the lease's expiry."""

    def __init__(self, hold: Hold, kill_after: float, stop: Flag, watchdog: Watchdog) -> None:
        ttl = hold.session.ttl  # as granted: etcd may raise it, never lower it
        self.hold = hold
        self.stop = stop
        self.watchdog = watchdog
        self.margin = deadline_margin(ttl)
        self.kill_after = min(kill_after, max_kill_after(ttl))
        self.box: Mailbox = queue.SimpleQueue()
        self._undo: list[Callable[[], None]] = []

    def confirm_lease(self) -> None:
        """Past the deadline before the child starts (an outage outlived E while we waited):
        wait up to the request timeout for the next confirmed keepalive, so that a lease etcd
        kept through the outage keeps its slot. A lease etcd no longer has sets ``hold.lost``."""
        hold, box = self.hold, queue.SimpleQueue[object]()
        give_up = time.monotonic() + hold.session.client.request_timeout
        undo = [hold.session.on_keepalive(lambda: box.put(None))]
        for flag in (hold.lost, self.stop):
            flag.subscribe(box)
            undo.append(partial(flag.unsubscribe, box))
        try:
            while not (hold.lost.is_set() or self.stop.is_set()):
                now = time.monotonic()
                if now < self.term_at() or now >= give_up:
                    return
                with contextlib.suppress(queue.Empty):
                    box.get(timeout=give_up - now)
        finally:
            for forget in undo:
                forget()

    def expiry(self) -> float:  # the lease's earliest expiry on the server
        return self.hold.session.alive_until

    def kill_at_latest(self) -> float:  # by when the child must be dead
        return self.expiry() - self.margin

    def term_at(self) -> float:  # the SIGTERM planned back from the deadline
        return self.kill_at_latest() - self.kill_after

    def grace_until(self) -> float:  # SIGKILL's instant for a termination that starts now
        return min(time.monotonic() + self.kill_after, self.kill_at_latest())

    def supervise(self, pid: int) -> int:  # the first notice after the child's start, acted on
        hold, watchdog = self.hold, self.watchdog
        hold.start_guard()
        started = time.monotonic()
        log.info("child-start", pid=pid, rev=hold.revision)
        # After the spawn, off the handoff's path: a watchdog dead before shows all the same.
        watchdog.watch(self.box)
        for flag in (hold.lost, self.stop):
            flag.subscribe(self.box)
            self._undo.append(partial(flag.unsubscribe, self.box))
        notice = self._first_notice()
        job = _Job(pid, self.box)
        if isinstance(notice, ChildExit):
            if not job.alive():
                # Nothing is left for the watchdog to kill: a revoke that outlasts the
                # deadline (etcd slow or frozen) must not fire it and turn the child's
                # status into a loss. The next holder waits for this revoke: it goes next.
                watchdog.dismiss()
                hold.release(log_it=False)
            code = _log_child_exit(pid, notice.returncode, started)
            if job.alive():  # a warning for each process that escaped the group
                if job.group_alive():
                    log.warning("stragglers", pgid=pid)
                self.terminate(job, child_running=False, kill_at=self.grace_until())
            watchdog.dismiss()
            if watchdog.fired:  # we were frozen past the deadline; the watchdog stopped it
                log.error("lost", name=hold.name, rev=hold.revision, reason=STALLED)
                return exit_code(Outcome.LOST_WHILE_RUNNING)
            return exit_code(Outcome.CHILD_EXITED, code)
        if notice is self.stop:
            log.info("signal", signum=self.stop.reason, pid=pid)
            returncode = self.terminate(job, child_running=True, kill_at=self.grace_until())
            return exit_code(Outcome.SIGNAL, _log_child_exit(pid, returncode, started))
        error = notice.error if isinstance(notice, WatchdogNotice) else None  # gone or silent
        if error is not None and not watchdog.fired:
            # No grace: with the watchdog gone or silent nothing else holds the deadline
            # should conch freeze during a grace (docs/design.md). SIGKILL at once.
            returncode = self.terminate(job, child_running=True, kill_at=time.monotonic())
            watchdog.kill()
            _log_child_exit(pid, returncode, started)
            return _report(Outcome.WATCHDOG_FAILED, error=error)
        log.error("lost", name=hold.name, rev=hold.revision, reason=self._loss_reason(notice))
        if self._hurry(notice):
            # Our key is gone in etcd itself: the slot may be someone else's already, so
            # a grace could only be spent beside its new holder. SIGKILL at once.
            kill_at = time.monotonic()
        else:
            kill_at = self.kill_at_latest() if notice is _DEADLINE else self.grace_until()
        returncode = self.terminate(job, child_running=True, kill_at=kill_at)
        # Before anything else, as after a child's exit; but not waited for past E (etcd frozen,
        # quorum lost: the usual reason for a loss), when it can no longer free the slot sooner.
        if not watchdog.fired:  # else conch was the one frozen, not etcd
            hold.release(
                log_it=False, until=min(self.expiry(), time.monotonic() + RELEASE_AFTER_LOSS)
            )
        _log_child_exit(pid, returncode, started)
        return exit_code(Outcome.LOST_WHILE_RUNNING)

    def _first_notice(self) -> object:
        # What came into the box, or _DEADLINE once the deadline's SIGTERM is due (read again
        # at each wake, as keepalives move it on).
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

    def terminate(self, job: _Job, child_running: bool, kill_at: float) -> int | None:
        """``job.stop`` (sooner on a ``_hurry`` notice), the watchdog standing by (rather
        than send a second SIGTERM into the child's cleanup at the deadline) to finish it
        should conch die meanwhile. Returns the child's return code (if ``child_running``)."""
        self.watchdog.stand_by(kill_at)
        return job.stop(child_running, kill_at, self._hurry)

    def _hurry(self, notice: object) -> bool:
        # SIGKILL now, without (or cutting short) a grace: the watchdog gone or silent, or our
        # key gone in etcd (the loss seen there: key deleted, lease unknown, by its kind).
        error = notice.error if isinstance(notice, WatchdogNotice) else None  # gone or silent
        if error is not None and not self.watchdog.fired:
            log.error(Outcome.WATCHDOG_FAILED.value, error=error)
            self.watchdog.kill()
            return True
        reason = Loss.of(self.hold.lost.reason) if notice is self.hold.lost else None
        return reason is not None and reason.slot_taken

    def finish(self) -> None:
        for undo in self._undo:
            undo()
        self.watchdog.dismiss()


def _log_child_exit(pid: int, returncode: int | None, started: float) -> int:
    # child-exit: the status as a shell reports it (None: not reaped even after SIGKILL,
    # counted as killed by it), and how long the child ran. Returns that status.
    if returncode is None:
        log.warning("child-unreaped", pid=pid, after=f"{procs.REAP_AFTER_KILL:g}s")
        returncode = -signal.SIGKILL
    code = exit_status(returncode)
    log.info("child-exit", pid=pid, code=code, ran=f"{time.monotonic() - started:.3f}s")
    return code


@contextlib.contextmanager
def stop_on_signals(stop: Flag, restore: bool = True) -> Iterator[Flag]:
    """While inside, every signal of STOP_SIGNALS (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1,
    SIGUSR2, SIGALRM, ..., the real-time signals) sets ``stop`` (reason: the signal number)
    instead of killing us, and SIGTSTP (^Z) is refused (a warning the first time): a stopped
    conch sends no keepalives while its child runs on. Any of them but SIGTERM ignored on
    entry stays ignored, here and in the child (``nohup``, a background job); one blocked is
    unblocked for the calling (main) thread. Process-wide:
    for the command, or a caller that owns the process's signals. The previous handlers come
    back on leaving, unless ``restore`` is False (a process about to exit with its child's
    status: a late signal must not turn that into death by the signal)."""
    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGTSTP)}
    for sig, handler in previous.items():
        if handler == signal.SIG_IGN and sig in KEEP_IGNORED:
            continue
        if sig == signal.SIGTSTP:
            signal.signal(sig, _refuse_suspend)
        else:
            signal.signal(sig, lambda signum, frame: stop.set(signum))
    # Blocked by whoever started us (exec keeps the mask), a signal would never reach them.
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, previous)
    try:
        yield stop
    finally:
        if restore:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_SUSPEND = "a stopped conch cannot keep its lease; stop the job with ^C or SIGTERM"
_suspend_refused: list[int] = []  # written once: a storm of ^Z must not nest handlers


def _refuse_suspend(signum: int, frame: object) -> None:
    if not _suspend_refused:
        _suspend_refused.append(signum)
        log.warning_from_signal_handler("suspend-refused", signum=signum, reason=_SUSPEND)
