"""The POSIX plumbing under the supervision loop (``conch.supervisor``): the spawn, the reaper
(it only reaps and tells: a slow etcd never holds up the reaping), the /proc scans (our
children, what escaped a job), the job's termination (its process group and what left it,
SIGTERM then SIGKILL), and the command's own process set up before it runs. Linux; no etcd,
no hold, no lease here. Rationale: docs/design.md, "Signals and the POSIX plumbing".
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from conch import log
from conch.flag import Mailbox, remaining

_adopting = False  # adopt_orphans() worked: every child of this process is ours to reap
_reap_lock = threading.RLock()  # held while reaping; reentrant: _Job.kill under it scans too
_spawned = threading.Event()  # a process started: the idle reaper looks again at once
_claimed: dict[int, Callable[[int], None]] = {}  # our children's pids -> their exit callbacks
_beside_jobs: dict[int, int] = {}  # our children no job's (watchdogs): pid -> start time

GROUP_POLL = 0.05  # seconds between checks that a process group is empty
SHELL = "/bin/sh"  # runs a script the kernel cannot execute, as execvp(3) does
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
GONE_AFTER_KILL = 2.0  # seconds to wait for SIGKILLed stragglers to be gone (zombies may stay)
REAP_AFTER_KILL = 10.0  # seconds to wait for a SIGKILLed child (stuck in D state: give up)


class ChildExit(NamedTuple):
    """Put into the supervisor's mailbox by the reaper: the child exited (a Popen return code)."""

    returncode: int


# Reset in the child: Python starts with them ignored, and ignored stays ignored across exec.
_RESET = tuple(
    getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ", "SIGXFZ", "SIGCHLD") if hasattr(signal, n)
)
# Errors on one PATH entry after which execvp(3) tries the next one.
_NEXT_ON = {errno.EACCES, errno.ENOENT, errno.ESTALE, errno.ENOTDIR, errno.ENODEV, errno.ETIMEDOUT}


def spawn(argv: Sequence[str], env: dict[str, str]) -> int:
    """Start ``argv`` (searched on PATH) in a new session and process group, with stdin,
    stdout and stderr only (as ``subprocess``'s ``close_fds``); return its pid. One
    ``posix_spawn``, which reports a failed exec (FileNotFoundError, PermissionError, other
    OSError). A file the kernel cannot execute (ENOEXEC: a script without a ``#!`` line) is
    run by /bin/sh, as ``execvp(3)``, and so ``flock(1)``, do."""
    # Our inheritable fds above stderr, closed in the child; one at or above the soft
    # RLIMIT_NOFILE cannot be named in a close action (EBADF): made close-on-exec instead.
    closes = []
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if (fd := int(name)) > 2 and os.get_inheritable(fd):
                    if limit == resource.RLIM_INFINITY or fd < limit:
                        closes.append((os.POSIX_SPAWN_CLOSE, fd))
                    else:
                        os.set_inheritable(fd, False)

    def start(path: str, args: list[str], launch: Callable[..., int] = os.posix_spawn) -> int:
        # Nothing blocked, the signals reset as by subprocess's restore_signals.
        return launch(
            path, args, env, file_actions=closes, setsid=True, setsigmask=(), setsigdef=_RESET
        )

    try:
        return start(argv[0], list(argv), os.posix_spawnp)
    except OSError as exc:
        if exc.errno != errno.ENOEXEC:
            raise
    # Search again, the way execvp(3) does, and give the file that says ENOEXEC to the shell
    # (an earlier one on PATH may have been skipped: ENOENT from a missing #! interpreter).
    name, denied = argv[0], False
    path_list = os.environ.get("PATH", os.defpath).split(":")  # "": the current directory
    for path in [name] if "/" in name else [os.path.join(entry, name) for entry in path_list]:
        try:
            return start(path, list(argv))
        except OSError as exc:
            if exc.errno == errno.ENOEXEC:
                return start(SHELL, [SHELL, path, *argv[1:]])
            if exc.errno not in _NEXT_ON:
                raise
            denied = denied or exc.errno == errno.EACCES
    if denied:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def adopt_orphans() -> bool:
    """Make this process a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) and start one
    thread that reaps every child it has: what a supervised child leaves behind is re-parented
    to us instead of PID 1 and reaped the moment it dies (a zombie still counts as a member
    of the group, and holds the slot until ``kill_after`` runs out). Process-wide: only for a
    process that waits for no children of its own (the ``conch`` command): the statuses of
    children ``run_child`` did not start are dropped, and an ignored SIGCHLD is set back to
    its default. Idempotent. Returns whether it worked."""
    global _adopting
    with _reap_lock:
        if _adopting:
            return True
        if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            except ValueError:  # not the main thread: waitpid() per child copes
                return False
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl
            _adopting = prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        if _adopting:
            threading.Thread(target=_reap_all, name="conch-reap", daemon=True).start()
        return _adopting


def _on_exit(pid: int, callback: Callable[[int], None]) -> None:
    """Call ``callback(wait_status)`` from a reaping thread once our child ``pid`` exits: the
    adopting reaper (``_reap_lock`` held since before the child existed), else its own."""
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
        log.call_back(callback, status, flag="child-exit")

    threading.Thread(target=wait, name="conch-reap", daemon=True).start()


def _reap_all() -> None:
    # Reap each child as it exits, and every other one that has exited by then too (what died
    # with a supervised child is no member of its group any more when its callback looks).
    while True:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # wait, reap nothing yet
        except ChildProcessError:
            # No child: an orphan may yet come. A start after the waitid sets _spawned; one
            # before is seen by the next waitid.
            _spawned.wait(GROUP_POLL)
            _spawned.clear()
            continue
        done: list[tuple[Callable[[int], None], int]] = []
        with _reap_lock, contextlib.suppress(ChildProcessError):
            while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                _beside_jobs.pop(reaped[0], None)
                if (callback := _claimed.pop(reaped[0], None)) is not None:
                    done.append((callback, reaped[1]))
        for callback, status in done:
            log.call_back(callback, status, flag="child-exit")  # the reaper reaps on


def _orphans() -> dict[int, _Stat]:  # our children conch did not start (none unless adopting)
    if not _adopting:
        return {}
    # No reaping meanwhile: a descendant is re-parented to us only as its parent dies, and
    # that parent (or an ancestor of it) is then a child of ours, in view until reaped.
    with _reap_lock:
        children = _children().items()
        return {p: s for p, s in children if p not in _claimed and _beside_jobs.get(p) != s.started}


_PER_THREAD_CHILDREN = "/proc/self/task/{}/children"  # Linux with CONFIG_PROC_CHILDREN
_children_files: bool | None = None  # whether this kernel has them; None: not looked yet


def _children() -> dict[int, _Stat]:  # zombies too: from our threads' children files, else /proc
    global _children_files
    if _children_files is None:
        _children_files = os.path.exists(_PER_THREAD_CHILDREN.format(threading.get_native_id()))
    for _ in range(3 if _children_files else 0):
        # A thread that ends meanwhile moves its children to another, perhaps one already read.
        with contextlib.suppress(FileNotFoundError):
            files = [_read(_PER_THREAD_CHILDREN.format(t)) for t in os.listdir("/proc/self/task")]
            pids = {int(pid) for content in files for pid in content.split()}
            return {pid: stat for pid in pids if (stat := _stat(pid)) is not None}
    stats = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat and stat.ppid == os.getpid()}


def _read(path: str) -> bytes:  # os calls: a third of the cost of open() here
    fd = os.open(path, os.O_RDONLY)
    try:
        return b"".join(iter(lambda: os.read(fd, 65536), b""))
    finally:
        os.close(fd)


class _Stat(NamedTuple):  # /proc/PID/stat
    ppid: int
    pgid: int
    state: str  # R, S, D, Z (a zombie), T (stopped), ...
    started: int  # clock ticks after boot


def _stat(pid: int) -> _Stat | None:  # None once the process is gone
    try:
        fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
        return _Stat(int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _command_line(pid: int) -> str:  # as ps shows it: the arguments, else [name] (a zombie)
    with contextlib.suppress(OSError):
        if text := _read(f"/proc/{pid}/cmdline")[:256].replace(b"\0", b" ").strip():
            return text.decode(errors="replace")
        return f"[{_read(f'/proc/{pid}/comm').strip().decode(errors='replace')}]"
    return "?"


class _Job:
    """The child's process group ``pgid`` and what the child left outside it, re-parented
    to us (``setsid cmd &``, a daemon's double fork): the slot is ours until all of it is
    gone. Each process that escaped is named once in an ``escaped`` warning, and gets what
    the group was last sent, also when it reaches us after that (its parent died of it).
    ``box``: the supervisor's mailbox, where the reaper puts the child's ChildExit."""

    def __init__(self, pgid: int, box: Mailbox) -> None:
        self.pgid = pgid
        self.box = box
        self._known: set[int] = set()
        self._sent: int | None = None

    def alive(self) -> bool:  # a member of the group or an escaped process is left
        return bool(self._escaped()) or self.group_alive()

    def group_alive(self) -> bool:
        try:
            with contextlib.suppress(PermissionError):  # a member not ours to signal lives
                os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal(self, sig: int) -> None:
        self._sent = sig
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)
        self._escaped(resend=True)

    def _escaped(self, resend: bool = False) -> dict[int, _Stat]:
        orphans = _orphans()
        for pid, stat in orphans.items():
            # In the group: signalled with it. A zombie: gone, but for its reaping.
            if new := not (stat.pgid == self.pgid or stat.state == "Z" or pid in self._known):
                self._known.add(pid)
                log.warning("escaped", pgid=self.pgid, pid=pid, cmd=_command_line(pid))
            if self._sent is not None and (new or resend):
                # One that leads a group gets it for the whole group (only the job's
                # processes can be in it: what it started in turn).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    (os.killpg if stat.pgid == pid else os.kill)(pid, self._sent)
        return orphans

    def kill(self) -> None:
        # SIGKILL, GONE_AFTER_KILL to be gone; never raises: on the way out of an error, which
        # must stay the one reported.
        with contextlib.suppress(Exception):
            self.signal(signal.SIGKILL)
            self._await_gone(time.monotonic() + GONE_AFTER_KILL)

    def stop(
        self, child_running: bool, kill_at: float, hurry: Callable[[object], bool]
    ) -> int | None:
        """SIGTERM the job; SIGKILL what is left of it at ``kill_at`` (``time.monotonic()``): at
        once, without SIGTERM, if that has passed, and as soon as a notice comes for which
        ``hurry(notice)`` is true. Returns the child's return code (if ``child_running``)."""
        returncode = None if child_running else 0
        if time.monotonic() < kill_at:
            self.signal(signal.SIGTERM)
            log.info("term-sent", pgid=self.pgid)
            returncode, kill_at = self._await_exit(kill_at, returncode, hurry)
            self._await_gone(kill_at)
        if returncode is None or self.alive():
            self.signal(signal.SIGKILL)
            log.warning("kill-sent", pgid=self.pgid)
            returncode, _ = self._await_exit(time.monotonic() + REAP_AFTER_KILL, returncode)
            # A SIGKILLed process is still running its exit (closing files, dropping locks): the
            # slot stays ours until it is gone, within a bound.
            self._await_gone(time.monotonic() + GONE_AFTER_KILL)
        return returncode if child_running else None

    def _await_gone(self, deadline: float) -> None:  # polled: grandchildren are not ours
        while self.alive() and time.monotonic() < deadline:
            time.sleep(min(GROUP_POLL, max(0.0, deadline - time.monotonic())))

    def _await_exit(
        self, deadline: float, code: int | None, hurry: Callable[[object], bool] | None = None
    ) -> tuple[int | None, float]:
        # The child's return code (``code`` if known; None: not reaped by ``deadline``) and the
        # deadline (now, once a notice for which ``hurry`` is true comes); others are dropped.
        while code is None:
            try:
                item = self.box.get(timeout=remaining(deadline))
            except queue.Empty:
                break
            if isinstance(item, ChildExit):
                return item.returncode, deadline
            if hurry is not None and hurry(item):
                return None, time.monotonic()
        return code, deadline


_COERCED_LC_CTYPE = ("C.UTF-8", "C.utf8", "UTF-8")  # what PEP 538 sets LC_CTYPE to


def undo_locale_coercion() -> None:
    """Python's own LC_CTYPE (PEP 538's coercion of the C locale) goes, the caller's, if it
    had one, comes back: the command's children (a cron job) run in the locale they would
    without conch. Only the command: a service that embeds conch may have set it itself."""
    if os.environ.get("LC_CTYPE") not in _COERCED_LC_CTYPE:
        return
    try:  # the environment this process was started with
        entries = _read("/proc/self/environ").split(b"\0")
    except OSError:
        return  # unknown: left as it is
    prefix = b"LC_CTYPE="
    given = [entry[len(prefix) :] for entry in entries if entry.startswith(prefix)]
    if given:
        os.environ["LC_CTYPE"] = os.fsdecode(given[0])  # LC_CTYPE=C or POSIX, coerced too
    else:
        del os.environ["LC_CTYPE"]


def reopen_closed_std_fds() -> None:
    """Started with stdin, stdout or stderr closed (cron's ``>&-``): point them at /dev/null,
    so neither our logging nor the child's inherited fds land somewhere unexpected."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            # Opened as the lowest free fd: this one (those below are open by now). It is
            # close-on-exec (PEP 446): closed again in the child, its first open() would take
            # it (its stderr written into its output file).
            os.set_inheritable(os.open(os.devnull, os.O_RDWR), True)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115
