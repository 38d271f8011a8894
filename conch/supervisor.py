"""The supervision loop (contract section 7): acquire, run the child, child exit or loss,
terminate, release. Written once; the CLI and embedders call ``supervise``."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from conch import etcd, hints, log
from conch.errors import EX_CANNOT_EXECUTE, EX_NOT_FOUND, EX_SOFTWARE, HoldLost, Interrupted
from conch.etcd.client import Backoff
from conch.flag import Flag, Mailbox, remaining
from conch.hold import Hold
from conch.semaphore import REENTRY_BACKOFF_CAP, Semaphore
from conch.watchdog import Watchdog

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


@dataclass(frozen=True)
class _ChildExit:
    returncode: int


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


def child_env(hold: Hold) -> dict[str, str]:
    """Our environment plus CONCH_NAME, CONCH_REV (fencing token), CONCH_LEASE, CONCH_MAX,
    less our GRPC_ENABLE_FORK_SUPPORT."""
    env = dict(os.environ)
    if etcd.FORK_SUPPORT_OFF:  # the command's setting, read when it runs
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    env.update(
        CONCH_NAME=hold.name,
        CONCH_REV=str(hold.revision),
        CONCH_LEASE=f"{hold.lease_id:x}",
        CONCH_MAX=str(hold.max),
    )
    return env


def supervise(
    sema: Semaphore,
    argv: Sequence[str],
    wait: float | None,
    kill_after: float,
    stop: Flag,
    watchdog: Watchdog | None = None,
) -> int:
    """Hold a slot of ``sema`` while ``argv`` runs; return the exit code (contract section 8).

    ``wait`` seconds for a slot (None: forever, 0: try once); ``kill_after`` seconds between
    SIGTERM and SIGKILL; ``stop`` set (by a signal) withdraws or terminates. Raises NoSlot,
    Interrupted, Unavailable from the acquisition; returns 70 when the hold was lost while
    the child ran. A hold lost before the child started (nothing ran) is given back and the
    slot queued for again, at the back of the queue, while ``wait`` allows (a ``requeue``
    warning; NoSlot once it does not). What the child leaves in its group is reaped as it
    dies only after ``adopt_orphans()`` (the command calls it); else a zombie among them
    holds the slot until PID 1 reaps it or ``kill_after`` runs out.
    ``watchdog`` (from ``start_watchdog(kill_after)``, started before connecting so that its
    interpreter starts while the connection is made) serves the first round; it is
    dismissed like one started here.
    """
    deadline = None if wait is None else time.monotonic() + wait
    backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
    while True:
        try:
            return _hold_and_run(sema, argv, remaining(deadline), kill_after, stop, watchdog)
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
) -> int:
    """One round of ``supervise``: a watchdog (``watchdog`` or a new one), a hold, the child.
    Raises HoldLost when the hold was lost before the child started."""
    try:
        # before queueing: its start-up is over by the slot
        watchdog = watchdog or start_watchdog(kill_after)
    except OSError as exc:
        log.error("watchdog-failed", error=str(exc))
        return EX_SOFTWARE
    try:
        hold = sema.acquire(wait, stop, guard=False)
        hold._warn_on_loss = False  # reported below as an error, with what became of the child
        try:
            if stop.is_set():
                raise Interrupted(stop.reason)
            return run_child(hold, argv, kill_after, stop, watchdog)
        finally:
            hold.release()
    finally:
        watchdog.dismiss()


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


def start_watchdog(kill_after: float) -> Watchdog:
    """A Watchdog, known to the adopting reaper as no part of any job (its process is our
    child too). Raises OSError as Watchdog does."""
    with _reap_lock:  # not reaped before it is known: its pid may come back as a job's
        watchdog = Watchdog(kill_after)
        if _adopting and (stat := _stat(watchdog.pid)) is not None:
            _beside_jobs[watchdog.pid] = stat.started
    _spawned.set()
    return watchdog


def run_child(
    hold: Hold, argv: Sequence[str], kill_after: float, stop: Flag, watchdog: Watchdog | None = None
) -> int:
    """Start ``argv`` in its own process group and wait for whichever comes first: its exit
    (return its status), the loss of ``hold`` (terminate it, return 70), or ``stop``
    (terminate it, return its status). Never starts it without a hold: raises HoldLost if
    it is lost (or its lease not certainly alive) before the child starts, Interrupted if
    ``stop`` is set before it starts.
    ``hold`` is released as soon as the child has exited with nothing left in its group
    and, after ``adopt_orphans()``, nothing left outside it either: what the child started
    and left in the background counts as the child until it is gone (a ``stragglers`` or an
    ``escaped`` warning, then SIGTERM, SIGKILL ``kill_after`` later), and is terminated
    with the child's group on a loss or ``stop``.
    ``watchdog`` (started in advance) is armed with the child's group; without one, one is
    started here, before the child."""
    try:
        watchdog = watchdog or start_watchdog(kill_after)
    except OSError as exc:
        log.error("watchdog-failed", error=str(exc))
        return EX_SOFTWARE
    if not watchdog.ready(WATCHDOG_START_TIMEOUT, stop):  # long since, unless the slot was free
        watchdog.dismiss()
        if stop.is_set():
            raise Interrupted(stop.reason)
        log.error("watchdog-failed", error=f"not running after {WATCHDOG_START_TIMEOUT:g}s")
        return EX_SOFTWARE
    # After the watchdog's start, which can take a while on a loaded machine.
    if stop.is_set():
        watchdog.dismiss()
        raise Interrupted(stop.reason)
    if hold.lost.is_set() or not hold.session.certainly_alive():
        watchdog.dismiss()
        reason = hold.lost.reason or "lease not confirmed alive (process stalled?)"
        raise HoldLost(f"hold lost before the child started: {reason}")
    box: Mailbox = queue.SimpleQueue()
    env = child_env(hold)
    try:
        # Before the child exists: a conch killed before the arm line below leaves it found.
        watchdog.expect({mark: env[mark] for mark in _MARKS}, hold.session.silence_limit)
    except OSError as exc:
        watchdog.dismiss()
        log.error("watchdog-failed", error=str(exc))
        return EX_SOFTWARE
    with _reap_lock:  # the adopting reaper takes no status until the child is claimed
        try:
            pid = spawn(argv, env)
        except (FileNotFoundError, ValueError):  # ValueError: an empty command name
            watchdog.dismiss()
            log.error("child-not-found", cmd=argv[0], **hints.not_found(argv[0]))
            return EX_NOT_FOUND
        except OSError as exc:
            watchdog.dismiss()
            log.error("child-cannot-execute", cmd=argv[0], error=exc.strerror or str(exc))
            return EX_CANNOT_EXECUTE
        try:
            try:
                watchdog.arm(pid)
                unarmed = None
            except OSError as exc:
                unarmed = exc
            _on_exit(pid, lambda status: _child_exited(pid, status, box, hold))
        except BaseException:  # no reaping thread (can't start new thread): fail closed
            _kill_group(pid)
            raise
    stop_heartbeats: Callable[[], None] | None = None
    try:  # from here on, whatever goes wrong, the child does not outlive our supervision
        if unarmed is not None:
            log.error("watchdog-failed", error=str(unarmed))
            _stop_group(_Job(pid), box, True, kill_after)
            return EX_SOFTWARE
        hold.start_guard()
        started = time.monotonic()
        log.info("child-start", pid=pid, rev=hold.revision)
        stop_heartbeats = hold.session.on_keepalive(watchdog.heartbeat)
        hold.lost.subscribe(box)
        stop.subscribe(box)
        item = box.get()
        if isinstance(item, _ChildExit):
            code = _log_child_exit(pid, item.returncode, started)
            job = _Job(pid)
            if job.alive():  # a warning for each process that escaped the group
                if _group_alive(pid):
                    log.warning("stragglers", pgid=pid)
                watchdog.stand_by()
                _stop_group(job, box, False, kill_after)
            watchdog.dismiss()
            if watchdog.fired:
                # We were frozen past the silence limit; the watchdog stopped the child.
                log.error(
                    "lost",
                    name=hold.name,
                    rev=hold.revision,
                    reason="wrapper stalled; the watchdog terminated the child",
                )
                return EX_SOFTWARE
            return code
        # From here conch terminates the group itself. The watchdog stands by: counting
        # silence it would only send a second SIGTERM into the child's cleanup, but should
        # conch die meanwhile (SIGKILL, OOM) it still finishes the termination.
        watchdog.stand_by()
        if item is hold.lost:
            reason = str(hold.lost.reason)
            if watchdog.fired:  # frozen past the silence limit: the key went meanwhile too
                reason = "wrapper stalled; the watchdog terminated the child"
            log.error("lost", name=hold.name, rev=hold.revision, reason=reason)
            _log_child_exit(pid, _stop_group(_Job(pid), box, True, kill_after), started)
            return EX_SOFTWARE
        log.info("signal", signum=stop.reason, pid=pid)
        exited = _stop_group(_Job(pid), box, True, kill_after)
        return _log_child_exit(pid, exited, started)
    except BaseException:
        # Fail closed: an error of ours (a bug, MemoryError) must not leave the child
        # running with nobody watching it while the slot is released.
        _kill_group(pid)
        raise
    finally:
        if stop_heartbeats is not None:
            stop_heartbeats()
        watchdog.dismiss()
        hold.lost.unsubscribe(box)
        stop.unsubscribe(box)


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
        callback(status)

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
            callback(status)


def _child_exited(pid: int, status: int, box: Mailbox, hold: Hold) -> None:
    """From the reaping thread: tell the supervisor, and if the child's process group went
    with it, release ``hold`` at once: the next holder waits for that revoke, and need not
    wait for the supervisor's bookkeeping too (a thread switch and the exit logging: a
    quarter of a millisecond at a handoff, measured). The ``release()`` that follows waits
    for this revoke and logs it."""
    box.put(_ChildExit(os.waitstatus_to_exitcode(status)))
    if not _group_alive(pid) and not _orphans():
        hold.release(log_it=False)


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


def _stop_group(job: _Job, box: Mailbox, child_running: bool, kill_after: float) -> int | None:
    """SIGTERM the job (its group and what escaped it); after ``kill_after`` seconds SIGKILL
    whatever is left of it. Waits for the child (if ``child_running``) to be reaped;
    returns its return code."""
    job.signal(signal.SIGTERM)
    log.info("term-sent", pgid=job.pgid)
    deadline = time.monotonic() + kill_after
    returncode = None if child_running else 0
    returncode = _await_exit(box, deadline, returncode)
    _await_gone(job, deadline)
    if returncode is None or job.alive():
        job.signal(signal.SIGKILL)
        log.warning("kill-sent", pgid=job.pgid)
        returncode = _await_exit(box, time.monotonic() + REAP_AFTER_KILL, returncode)
        # A SIGKILLed process is still running its exit (closing files, dropping locks,
        # freeing memory): the slot stays ours until it is gone, within a bound.
        _await_gone(job, time.monotonic() + GONE_AFTER_KILL)
    return returncode if child_running else None


def _await_gone(job: _Job, deadline: float) -> None:
    """Poll until nothing of ``job`` is left or ``deadline`` passes (grandchildren are not
    ours to wait() on)."""
    while job.alive() and time.monotonic() < deadline:
        time.sleep(GROUP_POLL)


def _await_exit(box: Mailbox, deadline: float | None, returncode: int | None) -> int | None:
    """Wait for the child's exit notice until ``deadline``; other notices are dropped."""
    while returncode is None:
        try:
            item = box.get(timeout=remaining(deadline))
        except queue.Empty:
            return None
        if isinstance(item, _ChildExit):
            return item.returncode
    return returncode
