"""The deadline (docs/failure-semantics.md): a child that ignores SIGTERM is dead before its
lease can expire on the server, whether conch notices a loss or not, whether conch or its
watchdog is the one awake; a loss seen in etcd itself kills at once; a watchdog's death is
noticed at once; a grace that cannot fit the TTL is refused; nested conch is quiet.

Every "before" is measured between real processes: the holder's child's death (the first
poll that finds it gone, so no earlier than its death) against the next holder's child's
start (its own ``date``, after the lease expired on the server and its key was deleted)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conchpb.etcdserverpb import rpc_pb2

import conch
from conch.errors import UsageError
from conch.etcd import Client, kv, lease
from conch.etcd.client import Endpoint
from conch.flag import Flag
from conch.settings import parse_duration
from conch.supervisor import check_kill_after, deadline_margin, max_kill_after, supervise
from tests.conftest import DEADLINE, Conch, Runner, alive, poll, sema_keys, stat_fields
from tests.etcd_server import EtcdCluster


def deaf_child(tmp_path: Path) -> tuple[list[str], Path]:
    """A child that ignores SIGTERM and records its pid; returns its argv and the pid file."""
    pidfile = tmp_path / "deaf.pid"
    script = (
        f"trap '' TERM; echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}; "
        "while :; do sleep 0.05; done"
    )
    return ["sh", "-c", script], pidfile


def obeying_child(tmp_path: Path) -> tuple[list[str], Path]:
    """A child that records its pid and dies of SIGTERM; its argv and the pid file."""
    pidfile = tmp_path / "obeying.pid"
    script = f"echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}; while :; do sleep 0.05; done"
    return ["sh", "-c", script], pidfile


def starts_at(tmp_path: Path, ident: str, other: Path | None = None) -> tuple[list[str], Path]:
    """A child that writes its start (wall clock, the host's) and exits; argv and file. With
    ``other`` (a pidfile), it first looks at that process: ``started`` says how it found it."""
    stamp = tmp_path / f"{ident}.start"
    look = "s=-"
    if other is not None:  # the state letter of /proc/PID/stat, or "gone"
        look = f's=gone; read -r _ _ s _ 2>/dev/null < "/proc/$(cat {other})/stat"'
    line = f'{look}; echo "$(date +%s.%N) $s" > {stamp}.new; mv {stamp}.new {stamp}'
    return ["sh", "-c", line], stamp


def started(stamp: Path) -> tuple[float, str]:
    """When ``starts_at``'s child started, and the state it found the other process in at
    that moment ("gone", "Z" for a zombie, "R", "S", ...): an order no poll's lag can blur."""
    poll(stamp.exists, what="the waiter's child")
    at, state = stamp.read_text().split()
    return float(at), state


def read_pid(pidfile: Path) -> int:
    return int(poll(lambda: pidfile.exists() and pidfile.read_text().strip(), what="child pid"))


def death_seen(pid: int, timeout: float = DEADLINE) -> float:
    """Poll (every 5 ms) until ``pid`` is gone or a zombie; the wall-clock time of the first
    poll that saw it so: no earlier than its death."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still alive after {timeout}s")
        time.sleep(0.005)
    return time.time()


def death_at(pid: int, timeout: float = DEADLINE) -> float:
    """The wall-clock time ``pid`` was seen to exit, from a pidfd (readable the moment the
    process has exited, zombie or not: no poll's lag between two processes' instants a few
    milliseconds apart). Raises AssertionError if it runs on past ``timeout``."""
    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            raise AssertionError(f"pid {pid} still alive after {timeout}s")
        return time.time()
    finally:
        os.close(fd)


def watchdog_of(holder: Conch) -> int:
    """The pid of the holder's watchdog (its child running _watchdog_main.py)."""

    def find() -> int:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == holder.pid and b"_watchdog_main.py" in cmdline:
                return int(name)
        return 0

    return poll(find, what="the holder's watchdog")


def leader_index(cluster: EtcdCluster) -> int:
    """The member every member names leader (polled until they agree)."""

    def agreed() -> int:
        statuses = []
        for member in cluster.members:
            try:
                with Client([Endpoint.parse(member.endpoint)]) as c:
                    statuses.append(c.call("maintenance", "Status", rpc_pb2.StatusRequest(), 2.0))
            except Exception:
                return 0
        leaders = {s.leader for s in statuses}
        ids = [s.header.member_id for s in statuses]
        if len(leaders) != 1 or next(iter(leaders)) not in ids:
            return 0
        return ids.index(next(iter(leaders))) + 1  # + 1: 0 is falsy to poll

    return poll(agreed, what="one leader") - 1


def _handover(
    child: int, waiter_started: Path, capsys: pytest.CaptureFixture[str], frozen: str
) -> tuple[float, float]:
    """The handover after a freeze (``frozen`` says which), timed from now: prints when
    ``child`` was seen dead and when the waiter's child started, and asserts that it was
    dead by then; returns (now, its death seen)."""
    frozen_at = time.time()
    died = death_seen(child)
    at, state = started(waiter_started)
    with capsys.disabled():
        print(
            f"\n[measure] {frozen}: child dead "
            f"{died - frozen_at:.2f}s after the freeze, {at - died:.3f}s before "
            "the next holder's child started"
        )
    assert state in ("gone", "Z"), f"the child was {state} as the next holder's child started"
    return frozen_at, died


@pytest.mark.alone
def test_a_sigterm_deaf_child_is_dead_before_its_lease_expires_when_its_member_freezes(
    cluster: EtcdCluster, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The holder's only member (a follower) frozen: no keepalive is answered, the lease
    expires on the leader one TTL after the last one, and a waiter on the other members
    takes the slot. The child, deaf to SIGTERM, must be dead before that waiter's child
    starts. Before the deadline, conch declared the loss at 2·TTL/3 + 1 s and sent the
    SIGKILL --kill-after later: 1.5 s into the next holder's run at these settings."""
    follower = (leader_index(cluster) + 1) % 3
    others = ",".join(m.endpoint for i, m in enumerate(cluster.members) if i != follower)
    runner = Runner(cluster, tmp_path)
    cmd, pidfile = deaf_child(tmp_path)
    waiter_cmd, waiter_started = starts_at(tmp_path, "waiter", pidfile)
    flags = ("--max", "1", "--ttl", "6s", "--kill-after", "2.5s")
    try:
        holder = runner.start(
            "sema", name, *flags, "--", *cmd, CONCH_ENDPOINTS=cluster.members[follower].endpoint
        )
        child = read_pid(pidfile)
        waiter = runner.start("sema", name, *flags, "--", *waiter_cmd, CONCH_ENDPOINTS=others)
        poll(lambda: "event=queued" in waiter.log(), what="the waiter queued")
        cluster.members[follower].pause()
        _handover(child, waiter_started, capsys, "member frozen, TTL 6s, --kill-after 2.5s")
        assert waiter.wait() == 0
        assert holder.wait() == 70  # every call to the frozen member has a deadline
        assert "event=kill-sent" in holder.log()
    finally:
        cluster.members[follower].resume()
        runner.cleanup()


def test_the_watchdog_kills_a_frozen_wrappers_child_before_the_lease_expires(
    conch: Runner, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """conch frozen (SIGSTOP) with its SIGTERM-deaf child running: its watchdog SIGKILLs the
    child's group at the lease's earliest expiry less the margin, from the expiry the last
    heartbeat carried, while conch never wakes. Before, it sent SIGTERM only, two keepalive
    intervals and two margins after the last heartbeat, and SIGKILL --kill-after later:
    past the expiry."""
    cmd, pidfile = deaf_child(tmp_path)
    waiter_cmd, waiter_started = starts_at(tmp_path, "waiter", pidfile)
    flags = ("--max", "1", "--ttl", "3s", "--kill-after", "1s")
    holder = conch.start("sema", name, *flags, "--", *cmd)
    child = read_pid(pidfile)
    waiter = conch.start("sema", name, *flags, "--", *waiter_cmd)
    poll(lambda: "event=queued" in waiter.log(), what="the waiter queued")
    holder.signal(signal.SIGSTOP)
    try:
        frozen_at, died = _handover(
            child, waiter_started, capsys, "wrapper frozen, TTL 3s, --kill-after 1s"
        )
        assert died - frozen_at < 3.0  # within the TTL of the last keepalive
    finally:
        holder.signal(signal.SIGCONT)
    assert holder.wait() == 70
    assert "watchdog terminated the child" in holder.log()
    assert waiter.wait() == 0


def test_a_watchdog_killed_while_the_child_runs_is_noticed_at_once_and_the_child_stopped(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """Without its watchdog, a conch that then froze or died would leave its child running
    past the lease. conch notices the watchdog's end the moment it comes (its stdout
    closes) and fails closed: the child is SIGKILLed at once (a grace would leave the
    deadline to a conch that may freeze in it), the slot released, exit 70. Before, nothing
    noticed: the child ran on."""
    cmd, pidfile = deaf_child(tmp_path)
    holder = conch.start(
        "sema", name, "--max", "1", "--ttl", "10s", "--kill-after", "5s", "--", *cmd
    )
    child = read_pid(pidfile)
    watchdog = watchdog_of(holder)
    killed_at = time.time()
    os.kill(watchdog, signal.SIGKILL)
    died = death_seen(child, timeout=15)
    assert died - killed_at < 2.0  # at once, not --kill-after (5 s) later; room for a busy host
    assert holder.wait() == 70
    assert "event=watchdog-failed" in holder.log()
    events = holder.events()
    assert "kill-sent" in events and "term-sent" not in events
    assert sema_keys(client, name) == []


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_watchdog_stopped_or_killed_while_conch_queues_fails_before_the_child_starts(
    conch: Runner, client: Client, name: str, tmp_path: Path, fault: signal.Signals
) -> None:
    """The waiter's watchdog, started before it queues, SIGSTOPped or SIGKILLed while it
    waits: when the slot comes, conch fails it (exit 70, ``watchdog-failed`` saying which)
    without starting the child, and gives the slot back. Before, a stopped watchdog was
    only probed once the child ran: the child was started, then SIGKILLed 0.1 s in; and a
    killed one was reported as "not running after 10s", at once."""
    gate = tmp_path / "release"
    holder = conch.start(
        "sema", name, "--max", "1", "--ttl", "3s", "--",
        "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done",
    )  # fmt: skip
    poll(lambda: "event=child-start" in holder.log(), what="the holder's child")
    waiter_cmd, waiter_started = starts_at(tmp_path, "waiter")
    waiter = conch.start("sema", name, "--max", "1", "--ttl", "3s", "--", *waiter_cmd)
    poll(lambda: "event=queued" in waiter.log(), what="the waiter queued")
    watchdog = watchdog_of(waiter)
    os.kill(watchdog, fault)
    if fault == signal.SIGSTOP:
        poll(lambda: (stat_fields(watchdog) or ["?"])[0] == "T", what="the watchdog stopped")
    else:
        poll(lambda: not alive(watchdog), what="the watchdog gone")
    gate.touch()
    assert holder.wait() == 0, holder.log()
    assert waiter.wait() == 70, waiter.log()
    assert not waiter_started.exists(), "the child started with a failed watchdog"
    failed = [line for line in waiter.log().splitlines() if "event=watchdog-failed" in line]
    # Stopped: found so in /proc, or (a loaded host: stopped before it could say it runs)
    # never ready; either way no child.
    said = ("cannot run (stopped)", "not running after") if fault == signal.SIGSTOP else ("exited",)
    assert len(failed) == 1 and any(s in failed[0] for s in said), waiter.log()
    assert "child-start" not in waiter.events()
    assert sema_keys(client, name) == []
    # Killed by conch, or (never ready) woken by conch's exit to find its pipe's end.
    poll(lambda: not alive(watchdog), what="the stopped watchdog gone")


# Spins on one CPU as a real-time task (SCHED_FIFO): nothing else gets that CPU for the
# seconds it is given (argv: the CPU, the seconds), short of the kernel's RT throttling
# (0.95 s of each second, sched_rt_runtime_us). It says "hogging" once it spins; exit 3:
# SCHED_FIFO refused (not root, no CAP_SYS_NICE, no RT runtime in its cgroup).
CPU_HOG = (
    "import os, sys, time\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "try: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))\n"
    "except OSError: sys.exit(3)\n"
    "print('hogging', flush=True)\n"
    "end = time.monotonic() + float(sys.argv[2])\n"
    "while time.monotonic() < end: pass\n"
)
STARVED_FOR = 0.5  # seconds the hog takes the watchdog's CPU: well under SLOW_ANSWER_TIMEOUT


def hog(cpu: int, seconds: float) -> subprocess.Popen[str]:
    """CPU_HOG on ``cpu`` for ``seconds``, once it spins; skips the test if it is refused."""
    argv = [sys.executable, "-c", CPU_HOG, str(cpu), str(seconds)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline() != "hogging\n":
        proc.wait()
        pytest.skip(f"SCHED_FIFO refused (exit {proc.returncode})")
    return proc


def pinned_to(cpus: set[int]) -> list[str]:
    """A launcher (``Runner.start``) that runs conch, and what it starts, on ``cpus`` only."""
    pin = f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)}); "
    return [sys.executable, "-c", pin + "os.execv(sys.argv[1], sys.argv[1:])"]


@pytest.mark.alone
def test_a_watchdog_runnable_but_starved_of_cpu_does_not_fail_the_hold(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """The holder's watchdog pinned to one CPU and a SCHED_FIFO hog spinning there for
    STARVED_FOR (0.5 s), twice while the child runs, conch on the other CPUs: the watchdog,
    runnable (state R) but not scheduled, answers its probes late, and the child runs to its
    end (exit 0). Before, any probe unanswered within 0.1 s failed it as a stopped one: the
    child SIGKILLed, exit 70, ``watchdog-failed`` (seen on a loaded 2-core host)."""
    if os.geteuid() != 0:
        pytest.skip("SCHED_FIFO needs root")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one to starve the watchdog on, one for conch")
    starved, others = cpus[-1], set(cpus[:-1])
    hog(starved, 0).wait()  # skips before anything starts if SCHED_FIFO is refused
    gate = tmp_path / "release"
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, others)  # this thread too: it looks at the watchdog meanwhile
    try:
        holder = conch.start(
            "sema", name, "--max", "1", "--",
            "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done",
            launcher=pinned_to(others),
        )  # fmt: skip
        poll(lambda: "event=child-start" in holder.log(), what="the holder's child")
        watchdog = watchdog_of(holder)
        os.sched_setaffinity(watchdog, {starved})
        states: list[str] = []

        def state() -> str:
            return (stat_fields(watchdog) or ["gone"])[0]

        for _ in range(2):
            spinning = hog(starved, STARVED_FOR)

            def woken() -> str:  # its state once a probe (every 0.1 s) woke it, or at the end
                now = state()
                return now if now == "R" or spinning.poll() is not None else ""  # noqa: B023

            states.append(poll(woken, what="a probe to wake the starved watchdog"))
            spinning.wait()
            poll(lambda: state() != "R", what="the watchdog scheduled again, its probes answered")
        gate.touch()
        assert holder.wait() == 0, holder.log()
    finally:
        os.sched_setaffinity(0, mine)
    assert states == ["R", "R"], f"the watchdog was not kept runnable and unscheduled: {states}"
    assert "watchdog-failed" not in holder.events()


def test_our_key_deleted_from_outside_sigkills_the_child_at_once(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """Our key gone in etcd itself: the slot may be someone else's already, so a grace
    could only be spent beside its new holder. The SIGTERM-deaf child is SIGKILLed at once,
    not --kill-after (here 5 s) later."""
    cmd, pidfile = deaf_child(tmp_path)
    holder = conch.start("sema", name, "--max", "1", "--kill-after", "5s", "--", *cmd)
    child = read_pid(pidfile)
    poll(lambda: "event=child-start" in holder.log(), what="child start logged")
    deleted_at = time.time()
    kv.delete(client, sema_keys(client, name)[0].key)
    died = death_seen(child)
    assert died - deleted_at < 2.0, f"the child ran {died - deleted_at:.2f}s after the deletion"
    assert holder.wait() == 70
    events = holder.events()
    assert "kill-sent" in events and "term-sent" not in events


def test_a_kill_after_that_cannot_fit_the_ttl_is_a_usage_error(
    conch: Runner, client: Client, name: str
) -> None:
    """--kill-after 2s at --ttl 3s: the SIGTERM it implies would come before the session
    could even miss a keepalive. Refused, one line, exit 64, nothing written to etcd; from
    CONCH_KILL_AFTER too. The default (5 s) is cut to what fits, silently."""
    by_flag = conch.run(
        "sema", name, "--max", "1", "--ttl", "3s", "--kill-after", "2s", "--", "true"
    )
    by_env = conch.run(
        "sema", name, "--max", "1", "--ttl", "3s", "--", "true", CONCH_KILL_AFTER="2s"
    )
    for code, _, err in (by_flag, by_env):
        assert code == 64, err
        [line] = err.splitlines()
        assert "does not fit" in line and f"{max_kill_after(3):.2f}s" in line
    assert sema_keys(client, name) == []
    code, _, err = conch.run("sema", name, "--max", "1", "--ttl", "3s", "-q", "--", "true")
    assert (code, err) == (0, "")


@pytest.mark.parametrize("ttl", [3, 4, 7, 10, 20])
def test_the_longest_grace_is_accepted_exactly_as_the_refusal_prints_it(ttl: int) -> None:
    """The refusal says "at most X s"; X itself is accepted. Before, the limit was rounded
    up in the message: --ttl 3s --kill-after 1.25s was refused "at most 1.25s" (the limit
    is 1.2467 s), --ttl 10s --kill-after 5.41s "at most 5.41s" (5.4067 s)."""
    with pytest.raises(UsageError) as refused:
        check_kill_after(ttl, ttl, "--kill-after")
    [shown] = re.findall(r"at most ([0-9.]+)s", str(refused.value))
    for text in (f"{shown}s", f"{float(shown) * 1000:g}ms"):
        given = parse_duration("--kill-after", text)
        assert check_kill_after(given, ttl) == min(given, max_kill_after(ttl))


def test_the_documented_longest_graces_are_accepted_by_the_command(
    conch: Runner, name: str
) -> None:
    """1.25 s at --ttl 3s and 5.41 s at 10 s, as the contract and the help give them."""
    for ttl, grace in (("3s", "1.25s"), ("10s", "5.41s")):
        code, _, err = conch.run(
            "sema", name, "--max", "1", "--ttl", ttl, "--kill-after", grace, "-q", "--", "true"
        )
        assert (code, err) == (0, "")


def test_a_refused_grace_just_past_the_limit_is_shown_as_asked() -> None:
    """Before, the grace was shown rounded as the limit is: ``--kill-after 1.2500001s``
    was refused as "1.25s does not fit a 3s TTL: at most 1.25s"."""
    with pytest.raises(UsageError) as refused:
        check_kill_after(parse_duration("--kill-after", "1.2500001s"), 3, "--kill-after")
    assert str(refused.value).startswith("--kill-after 1.2500001s does not fit"), refused.value
    assert "at most 1.25s" in str(refused.value)


def test_supervise_refuses_a_kill_after_that_cannot_fit_the_ttl(client: Client, name: str) -> None:
    sema = conch.Semaphore(client, name, max=1, ttl=3)
    with pytest.raises(UsageError, match="does not fit"):
        supervise(sema, ["true"], None, 2.0, Flag("stop"))
    assert sema_keys(client, name) == []


def test_nested_conch_is_quiet(conch: Runner, name: str) -> None:
    """The README's nested example: the inner conch's watchdog used to outlive the inner
    conch by a moment, outside the child's group, and the outer reported it ``escaped`` and
    stopped it. The inner now waits for its watchdog's exit."""
    inner = [sys.executable, "-m", "conch", "sema", f"{name}-inner", "--max", "1", "-q"]
    for _ in range(3):
        code, out, err = conch.run("sema", name, "--max", "1", "-q", "--", *inner, "--", "true")
        assert (code, out, err) == (0, "", "")


def test_hold_expires_at_is_the_last_confirmed_keepalive_plus_the_ttl(
    client: Client, name: str
) -> None:
    """``expires_at()``/``deadline``: the send time of the last answered keepalive plus the
    TTL, monotonic; moved on by keepalives; long past once the hold is lost."""
    asked = time.monotonic()
    hold = conch.Semaphore(client, name, max=1, ttl=3).acquire(timeout=10)
    try:
        first = hold.expires_at()
        assert asked + 3 <= first <= time.monotonic() + 3
        assert hold.deadline == first
        assert 0 < hold.remaining() <= 3
        poll(lambda: hold.expires_at() > first, timeout=10, what="a keepalive to move it")
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(DEADLINE)
        assert hold.expires_at() == 0.0 and hold.remaining() == 0.0
    finally:
        hold.release()


def test_hold_deadline_bounds_asyncio_work_to_the_lease(tmp_path: Path, name: str) -> None:
    """With its etcd frozen, a step bounded by ``asyncio.timeout_at(hold.deadline - margin)``
    ends before the lease can expire: at the deadline, not when the step would."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    try:
        with solo.client() as client:
            hold = conch.Semaphore(client, name, max=1, ttl=3).acquire(timeout=10)
            margin = deadline_margin(3)
            solo.members[0].pause()
            frozen = time.monotonic()

            async def step() -> float:
                try:
                    async with asyncio.timeout_at(hold.deadline - margin) as bound:
                        while True:  # a long job, in steps
                            await asyncio.sleep(0.05)
                            bound.reschedule(hold.deadline - margin)
                except TimeoutError:
                    return time.monotonic()
                raise AssertionError("unreachable")

            ended = asyncio.run(step())
            assert ended < frozen + 3  # the lease's TTL from the last keepalive at most
            assert ended <= hold.session.alive_until - margin + 0.1
            solo.members[0].resume()
            hold.release()
    finally:
        solo.members[0].resume()
        solo.stop()


def exit_seen(holder: Conch, timeout: float = DEADLINE) -> tuple[int, float]:
    """Poll (every 5 ms) until ``holder`` has exited; its code and the wall-clock time of the
    first poll that saw it gone: no earlier than its exit."""
    deadline = time.monotonic() + timeout
    while (code := holder.process.poll()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"conch {holder.pid} still running after {timeout}s")
        time.sleep(0.005)
    return code, time.time()


# What "promptly" means for an exit after a loss (contract section 7): measured from the
# child's death as seen by a 5 ms poll, so a few ms of it are the poll's own.
PROMPT_EXIT = 0.5


def _exit_after_a_fault(
    runner: Runner,
    name: str,
    tmp_path: Path,
    fault: Callable[[], None],
    what: str,
    capsys: pytest.CaptureFixture[str],
    deaf: bool,
) -> None:
    """A child (``deaf`` to SIGTERM: dead at the SIGKILL, E - margin; else at the SIGTERM,
    --kill-after earlier) of a holder at --ttl 3s --kill-after 1s; ``fault`` cuts the holder
    from etcd: conch exits 70 within PROMPT_EXIT of the child's death, however long its
    release would take against an etcd that does not answer."""
    cmd, pidfile = deaf_child(tmp_path) if deaf else obeying_child(tmp_path)
    what += ", child deaf to SIGTERM" if deaf else ", child obeys SIGTERM"
    holder = runner.start(
        "sema", name, "--max", "1", "--ttl", "3s", "--kill-after", "1s", "--", *cmd
    )
    child = read_pid(pidfile)
    poll(lambda: "event=child-start" in holder.log(), what="child start logged")
    fault()
    fault_at = time.time()  # in effect: the second member stopped, or etcd frozen
    died = death_seen(child)
    code, exited = exit_seen(holder)
    with capsys.disabled():
        print(
            f"\n[measure] {what}, TTL 3s, --kill-after 1s: child dead {died - fault_at:.3f}s "
            f"after the fault, conch exited {exited - fault_at:.3f}s after it "
            f"({exited - died:.3f}s after the child's death)"
        )
    assert code == 70, holder.log()
    assert exited - died < PROMPT_EXIT, holder.log()


@pytest.mark.parametrize("deaf", [True, False], ids=["deaf", "obeying"])
def test_conch_exits_promptly_after_a_loss_when_etcd_is_frozen(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str], deaf: bool
) -> None:
    """etcd frozen (SIGSTOP): the release after the loss cannot get through, and helps no
    one once the lease can expire. Before, conch waited for it past the lease's earliest
    expiry: it exited 6.2-7.2 s into the fault, the child dead since 1.2-2.1 s."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    runner = Runner(solo, tmp_path)
    try:
        freeze = solo.members[0].pause
        _exit_after_a_fault(runner, name, tmp_path, freeze, "etcd frozen", capsys, deaf)
    finally:
        solo.members[0].resume()
        runner.cleanup()
        solo.stop()


@pytest.mark.parametrize("deaf", [True, False], ids=["deaf", "obeying"])
def test_conch_exits_promptly_after_a_loss_when_quorum_is_lost(
    cluster: EtcdCluster,
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    deaf: bool,
) -> None:
    """Two of three members stopped: the one left answers nothing that needs the leader."""

    def lose_quorum() -> None:
        cluster.members[1].stop()
        cluster.members[2].stop()

    runner = Runner(cluster, tmp_path)
    try:
        _exit_after_a_fault(runner, name, tmp_path, lose_quorum, "quorum lost", capsys, deaf)
    finally:
        runner.cleanup()


# Seconds from the fault on the watchdog to the one on conch, where conch is to notice the
# first: 0.5 s, as the overlap harness (a watchdog answers its probes within 0.1 s, probed
# every 0.1 s). 0 for a conch SIGKILLed right behind its stopped watchdog: no time to notice,
# the kernel's SIGCONT on conch's death is what wakes the watchdog.
WATCHDOG_TO_CONCH = 0.5


@pytest.mark.parametrize("run", [1, 2])
@pytest.mark.parametrize(
    ("on_watchdog", "on_conch"),
    [
        (signal.SIGKILL, signal.SIGSTOP),
        (signal.SIGKILL, signal.SIGKILL),
        (signal.SIGSTOP, signal.SIGSTOP),
        (signal.SIGSTOP, signal.SIGKILL),
    ],
    ids=["watchdog-killed-conch-frozen", "watchdog-killed-conch-killed",
         "watchdog-stopped-conch-frozen", "watchdog-stopped-conch-killed"],
)  # fmt: skip
def test_a_watchdog_killed_or_stopped_then_conch_frozen_or_killed_leaves_no_overlap_no_orphan(
    conch: Runner,
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    on_watchdog: signal.Signals,
    on_conch: signal.Signals,
    run: int,
) -> None:
    """The holder's watchdog SIGKILLed or SIGSTOPped, then conch itself frozen or
    SIGKILLed, a waiter queued behind it: the SIGTERM-deaf child is dead before the
    waiter's child starts, and dies at all (no orphan left running). Before, a stopped
    watchdog went unnoticed: conch frozen next let the child run 17 s past its lease, conch
    SIGKILLed next left it orphaned beside the next holder until the watchdog was resumed."""
    cmd, pidfile = deaf_child(tmp_path)
    waiter_cmd, waiter_started = starts_at(tmp_path, "waiter", pidfile)
    flags = ("--max", "1", "--ttl", "3s", "--kill-after", "1s")
    holder = conch.start("sema", name, *flags, "--", *cmd)
    child = read_pid(pidfile)
    waiter = conch.start("sema", name, *flags, "--", *waiter_cmd)
    poll(lambda: "event=queued" in waiter.log(), what="the waiter queued")
    watchdog = watchdog_of(holder)
    delay = (
        0.0 if (on_watchdog, on_conch) == (signal.SIGSTOP, signal.SIGKILL) else WATCHDOG_TO_CONCH
    )
    what = f"watchdog {on_watchdog.name}, conch {on_conch.name} {delay:g}s later (run {run})"
    seen: list[float] = []
    watcher = threading.Thread(target=lambda: seen.append(death_at(child)), daemon=True)
    try:
        watcher.start()  # from before the faults: the child may die between them
        fault_at = time.time()
        os.kill(watchdog, on_watchdog)
        if delay:
            time.sleep(delay)  # the fault's own timing, not a wait for anything
        with contextlib.suppress(ProcessLookupError):  # it may have exited 70 already
            holder.signal(on_conch)
        watcher.join(DEADLINE + 5)
        assert seen, f"the child {child} outlived its conch and watchdog: an orphan"
        died = seen[0]
        at, state = started(waiter_started)
        with capsys.disabled():
            print(
                f"\n[measure] {what}: child dead {died - fault_at:.3f}s after the first fault, "
                f"{at - died:.3f}s before the next holder's child started"
            )
        assert state in ("gone", "Z"), f"the child was {state} as the next holder's started"
    finally:
        holder.signal(signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(watchdog, signal.SIGCONT)
    code = holder.wait()
    assert code == (-signal.SIGKILL if on_conch == signal.SIGKILL and code < 0 else 70), (
        holder.log()
    )
    assert waiter.wait() == 0


def test_a_revoke_that_outlasts_the_deadline_after_the_child_exited_keeps_its_status(
    tmp_path: Path, name: str
) -> None:
    """The child freezes etcd (SIGSTOP) and exits 0: conch's revoke then waits out its 5 s
    request timeout, past the lease's deadline at --ttl 3s. The child's group is gone, so the
    watchdog has nothing to do: conch exits with the child's status, having said the revoke
    failed. Before, the watchdog fired at the deadline and conch exited 70 ("wrapper
    stalled"), as the auth-churn test saw when etcd was slow to answer a revoke."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    runner = Runner(solo, tmp_path)
    member = solo.members[0]
    assert member.process is not None
    try:
        holder = runner.start(
            "sema",
            name,
            "--max",
            "1",
            "--",
            "sh",
            "-c",
            f"kill -STOP {member.process.pid}",
            CONCH_TTL="3s",
        )
        code = holder.wait()
        log = holder.log()
        assert code == 0, log
        assert "event=revoke-failed" in log and "revoked=False" in log, log
        assert "wrapper stalled" not in log, log
    finally:
        member.resume()
        runner.cleanup()
        solo.stop()
