"""Failure semantics (contract section 10) against real etcd: dead and frozen wrappers, a
3-member cluster losing members and quorum, a whole-etcd outage, compaction, hostile keys."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb.kv_pb2 import Event

from conch.errors import EtcdError
from conch.etcd import Client, Endpoint, kv, lease
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag
from conch.identity import Identity
from conch.semaphore import Semaphore
from tests.conftest import (
    DEADLINE,
    Conch,
    Gate,
    Runner,
    alive,
    other_keys,
    poll,
    sema_keys,
    stat_fields,
    who_json,
)
from tests.delayproxy import FaultProxy
from tests.etcd_server import EtcdCluster, etcdctl_binary

T = TypeVar("T")


def wait_gone(pid: int, timeout: float) -> None:
    poll(lambda: not alive(pid), timeout=timeout, what=f"pid {pid} to be terminated")


def child_and_grandchild(tmp_path: Path) -> tuple[list[str], Path]:
    pids = tmp_path / "pids"
    return ["sh", "-c", f"sleep 600 & echo $$ $! > {pids}; wait"], pids


def read_pids(pids: Path) -> list[int]:
    poll(lambda: pids.exists() and len(pids.read_text().split()) == 2, what="child pids")
    return [int(p) for p in pids.read_text().split()]


# -- wrappers that die or freeze -------------------------------------------------------------


def test_sigkilled_wrapper_takes_child_and_grandchild_with_it(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    cmd, pids = child_and_grandchild(tmp_path)
    proc = conch.start("sema", name, "--max", "1", "--", *cmd)
    child, grandchild = read_pids(pids)
    proc.process.kill()  # the wrapper alone, not its group
    proc.process.wait()
    try:
        for pid in (child, grandchild):
            wait_gone(pid, timeout=10)
    finally:  # a child left running by a failure does not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)


# Runs conch SIGKILLed the moment its child exists, before it can arm the watchdog with the
# child's process group: the instant a SIGKILL under load happened to hit.
KILLED_BEFORE_ARMING = (
    sys.executable,
    "-c",
    "import os, runpy, signal, sys; from conch.watchdog import Watchdog; "
    "Watchdog.arm = lambda *args: os.kill(os.getpid(), signal.SIGKILL); "
    "sys.argv = sys.argv[3:]; runpy.run_module('conch', run_name='__main__', alter_sys=True)",
)


def command_lines_with(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text``."""
    found = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if name.isdigit() and text in Path(f"/proc/{name}/cmdline").read_text(errors="replace"):
                found.append(int(name))
    return found


def test_wrapper_sigkilled_before_it_armed_the_watchdog_takes_its_child_with_it(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """conch dies between starting the child and telling the watchdog the child's process
    group: the watchdog still terminates the child and what it started (it used to leave,
    as if there were no child, and both ran on unwatched)."""
    cmd, pids = child_and_grandchild(tmp_path)
    proc = conch.start("sema", name, "--max", "1", "--", *cmd, launcher=KILLED_BEFORE_ARMING)
    try:
        # Killed by its own SIGKILL, after posix_spawn returned: the child exists.
        assert proc.wait() == -signal.SIGKILL
        poll(
            lambda: not [pid for pid in command_lines_with(str(pids)) if alive(pid)],
            timeout=10,
            what="the child to be terminated",
        )
        if pids.exists() and len(pids.read_text().split()) == 2:
            wait_gone(read_pids(pids)[1], timeout=10)
    finally:  # a child left running by a failure does not outlive the test
        with contextlib.suppress(ProcessLookupError):
            for pid in command_lines_with(str(pids)):
                os.killpg(pid, signal.SIGKILL)
            if pids.exists() and len(pids.read_text().split()) == 2:
                os.kill(read_pids(pids)[1], signal.SIGKILL)


def deaf_to_sigterm(pidfile: Path) -> str:
    """A shell loop that ignores SIGTERM and writes its pid to ``pidfile`` once it does."""
    return (
        f"trap '' TERM; echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}; "
        "while :; do sleep 0.1; done"
    )


def left_behind(script: str, pidfile: Path) -> str:
    """A child that starts ``script`` in the background (in its process group) and exits
    once ``pidfile`` is written."""
    quoted = script.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'sh -c "{quoted}" & while [ ! -s {pidfile} ]; do sleep 0.01; done'


def read_pid(pidfile: Path) -> int:
    return int(poll(lambda: pidfile.exists() and pidfile.read_text(), what=f"{pidfile.name}"))


@contextlib.contextmanager
def reaped_at_the_end(pidfile: Path) -> Iterator[None]:
    """Whatever the test finds, the process named in ``pidfile`` does not outlive it."""
    try:
        yield
    finally:
        if pidfile.exists() and pidfile.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def start_with_straggler(
    conch: Runner, name: str, pidfile: Path, kill_after: str
) -> tuple[Conch, int]:
    """conch running a child that exits at once, leaving in its group a process that
    ignores SIGTERM (the child leaves only once it does); returns conch and that pid."""
    script = left_behind(deaf_to_sigterm(pidfile), pidfile)
    proc = conch.start(
        "sema", name, "--max", "1", "--kill-after", kill_after, "--", "sh", "-c", script
    )
    return proc, read_pid(pidfile)


def test_slot_stays_held_until_a_straggler_left_by_the_child_is_gone(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """The child exits at once but leaves a process in its group that ignores SIGTERM: the
    slot is released only after the SIGKILL that follows --kill-after, never at the
    child's exit."""
    pidfile = tmp_path / "straggler"
    with reaped_at_the_end(pidfile):
        proc, straggler = start_with_straggler(conch, name, pidfile, "1s")
        poll(lambda: not sema_keys(client, name), what="the slot to be released")
        assert not alive(straggler), "the slot was released while the straggler still ran"
        assert proc.wait() == 0
        assert "event=stragglers" in proc.log() and "event=kill-sent" in proc.log()


# A stand-in for a container's PID 1 that never reaps orphans: a child subreaper that runs the
# command line it is given and waits for that one process only.
NO_REAPING_INIT = (
    sys.executable,
    "-c",
    "import ctypes, subprocess, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
    "sys.exit(subprocess.call(sys.argv[1:]))",
)


def parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def test_straggler_that_dies_of_sigterm_frees_the_slot_at_once_where_orphans_are_not_reaped(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """Under an init that never reaps orphans, the child exits leaving a process in its group
    that dies at conch's SIGTERM. A zombie still counts as a member of the group; conch reaps
    what the child left behind, so the slot is free at once, not after --kill-after."""
    pidfile = tmp_path / "straggler"
    script = f"sleep 600 & echo $! > {pidfile}; exit 0"
    with reaped_at_the_end(pidfile):
        proc = conch.start(
            "sema",
            name,
            "--max",
            "1",
            "--ttl",
            "100s",
            "--kill-after",
            "60s",
            "--",
            "sh",
            "-c",
            script,
            launcher=NO_REAPING_INIT,
        )
        assert proc.wait(timeout=30) == 0
        assert sema_keys(client, name) == []
        events = proc.events()
        assert "stragglers" in events and "term-sent" in events and "kill-sent" not in events
        assert parent_of(read_pid(pidfile)) is None, "the straggler was left a zombie"


def test_what_the_child_leaves_behind_is_adopted_by_conch(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """The command makes itself a child subreaper: a process the child leaves in its group is
    re-parented to conch (which reaps it when it dies), not to PID 1."""
    pidfile = tmp_path / "straggler"
    with reaped_at_the_end(pidfile):
        proc, straggler = start_with_straggler(conch, name, pidfile, "2s")
        poll(lambda: parent_of(straggler) == proc.pid, what="the straggler re-parented to conch")
        assert proc.wait() == 0


def zombies_of(pid: int) -> int:
    fields = [stat_fields(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()]
    return sum(f is not None and f[0] == "Z" and int(f[1]) == pid for f in fields)


def test_orphans_that_die_while_the_child_runs_are_reaped_at_once(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """What the child double-forks is re-parented to conch; a long job that does so again
    and again must not fill the process table with conch's zombies while it runs."""
    ready, gate = tmp_path / "ready", tmp_path / "gate"
    script = (
        "i=0; while [ $i -lt 100 ]; do (true &); i=$((i+1)); done; "
        f"touch {ready}; while [ ! -e {gate} ]; do sleep 0.05; done"
    )
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script)
    poll(ready.exists, what="the child to double-fork 100 processes")
    poll(lambda: zombies_of(proc.pid) == 0, what="conch to reap the orphans")
    gate.touch()
    assert proc.wait() == 0


# A child that leaves a member of its group whose parent is outside the group (and deaf to
# SIGTERM) and exits once that parent is out of the group; the parent exits a while after
# conch's SIGTERM killed the member, without reaping it: it reaches conch late, a zombie.
LATE_ORPHAN = """
import os, signal, time
ready_r, ready_w = os.pipe()
if os.fork() == 0:
    member = os.fork()
    if member == 0:
        signal.pause()  # until conch's SIGTERM to the child's group
        os._exit(0)
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(ready_w, b"x")
    os.waitid(os.P_PID, member, os.WEXITED | os.WNOWAIT)  # dead, and left unreaped
    time.sleep(0.3)  # the scenario: the zombie reaches conch this much later
    os._exit(0)
os.read(ready_r, 1)  # the member's parent is out of the group and deaf to SIGTERM
"""


def test_a_member_orphaned_late_does_not_hold_the_slot_until_kill_after(
    conch: Runner, client: Client, name: str
) -> None:
    proc = conch.start(
        "sema",
        name,
        "--max",
        "1",
        "--ttl",
        "100s",
        "--kill-after",
        "60s",
        "--",
        sys.executable,
        "-c",
        LATE_ORPHAN,
    )
    assert proc.wait(timeout=30) == 0
    assert sema_keys(client, name) == []
    assert "kill-sent" not in proc.events()


# A parent that ignores SIGCHLD and execs conch: conch inherits the ignored disposition.
SIGCHLD_IGNORED = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


def test_started_with_sigchld_ignored_conch_still_gets_the_childs_status(
    conch: Runner, client: Client, name: str
) -> None:
    """With SIGCHLD ignored the kernel reaps children itself and waitpid finds none: conch
    hung holding the slot. It resets SIGCHLD, for itself and for the child."""
    proc = conch.start(
        "sema", name, "--max", "1", "--", "cat", "/proc/self/status", launcher=SIGCHLD_IGNORED
    )
    assert proc.wait() == 0
    ignored = next(line.split()[1] for line in proc.stdout().splitlines() if "SigIgn" in line)
    assert not int(ignored, 16) & (1 << (signal.SIGCHLD - 1)), "the child inherited it"
    assert sema_keys(client, name) == []


def test_wrapper_killed_while_it_stops_stragglers_leaves_them_to_the_watchdog(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "straggler"
    with reaped_at_the_end(pidfile):
        proc, straggler = start_with_straggler(conch, name, pidfile, "2s")
        poll(lambda: "event=term-sent" in proc.log(), what="conch to start on the straggler")
        proc.process.kill()  # SIGKILL, OOM killer: conch cannot finish the job itself
        proc.process.wait()
        wait_gone(straggler, timeout=15)  # the watchdog's SIGKILL, 2 s + 1 s after stand-by


@contextlib.contextmanager
def terminating_after_a_loss(
    tmp_path: Path, name: str, pidfile: Path
) -> Iterator[tuple[Conch, int]]:
    """conch whose SIGTERM-deaf child is being terminated because its etcd froze (no
    keepalive answered: term-sent logged at the deadline's SIGTERM, its SIGKILL due 2.5 s
    later, before the lease can expire); yields conch and the child's pid. A loss seen in
    etcd itself (our lease revoked) gets no grace to freeze conch in: SIGKILL at once."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    runner = Runner(solo, tmp_path)
    script = deaf_to_sigterm(pidfile)
    try:
        proc = runner.start(
            "sema",
            name,
            "--max",
            "1",
            "--ttl",
            "6s",
            "--kill-after",
            "2.5s",
            "--",
            "sh",
            "-c",
            script,
        )
        child = read_pid(pidfile)
        solo.members[0].pause()
        poll(lambda: "event=term-sent" in proc.log(), what="conch to start on its child")
        yield proc, child
    finally:
        solo.members[0].resume()
        runner.cleanup()
        solo.stop()


def test_wrapper_frozen_while_it_stops_a_child_after_a_loss_still_gets_it_killed(
    name: str, tmp_path: Path
) -> None:
    """conch stopped (SIGSTOP) between its SIGTERM and its SIGKILL: the watchdog, standing
    by, sends the SIGKILL by the lease's deadline."""
    pidfile = tmp_path / "child"
    with (
        reaped_at_the_end(pidfile),
        terminating_after_a_loss(tmp_path, name, pidfile) as (
            proc,
            child,
        ),
    ):
        proc.signal(signal.SIGSTOP)
        try:
            wait_gone(child, timeout=15)  # by the deadline, 2.5 s after the SIGTERM
        finally:
            proc.signal(signal.SIGCONT)
        assert proc.wait() == 70


def test_wrapper_killed_while_it_stops_a_child_after_a_loss_leaves_it_to_the_watchdog(
    name: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "child"
    with (
        reaped_at_the_end(pidfile),
        terminating_after_a_loss(tmp_path, name, pidfile) as (
            proc,
            child,
        ),
    ):
        proc.process.kill()
        proc.process.wait()
        wait_gone(child, timeout=15)


def test_frozen_wrapper_child_is_stopped_before_a_waiter_takes_over(
    conch: Runner,
    gate: Gate,
    client: Client,
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cmd, pids = child_and_grandchild(tmp_path)
    holder = conch.start("sema", name, "--max", "1", "--ttl", "3s", "--", *cmd)
    child, grandchild = read_pids(pids)
    waiter = conch.start("sema", name, "--max", "1", "--ttl", "3s", "--", *gate.cmd("w"))
    poll(lambda: len(sema_keys(client, name)) == 2, what="waiter queued")
    holder.signal(signal.SIGSTOP)  # a GC pause or a partition, longer than the TTL
    try:
        frozen_at = time.monotonic()
        for pid in (child, grandchild):
            wait_gone(pid, timeout=15)
        stopped_after = time.monotonic() - frozen_at
        with capsys.disabled():
            print(f"\n[measure] frozen wrapper -> child stopped by watchdog: {stopped_after:.2f}s")
        poll(lambda: gate.now_running() == {"w"}, what="the waiter to take the slot")
        # The watchdog acts at two keepalive intervals plus two margins (3 s for TTL 3 s),
        # no later than the lease can expire.
        assert stopped_after < 3 + 2.0
    finally:
        holder.signal(signal.SIGCONT)
    assert holder.wait() == 70
    assert "watchdog terminated the child" in holder.log()
    gate.release("w")
    assert waiter.wait() == 0


# -- a 3-member cluster ------------------------------------------------------------------------


def cluster_runner(cluster: EtcdCluster, tmp_path: Path) -> Runner:
    return Runner(cluster, tmp_path)


def answered(call: Callable[..., T], *args: object) -> T | None:
    """``call(*args)``, or None while etcd cannot answer (no leader yet)."""
    with contextlib.suppress(EtcdError):
        return call(*args)
    return None


def expiry_floor(client: Client, lease_id: int) -> float:
    """A lower bound of the lease's expiry on the server (monotonic; etcd answers whole
    seconds left, rounded down, so the expiry is under this + 1): a bound that rose by more
    than 1 means a keepalive moved the expiry on. Fails once the lease is gone."""
    left = poll(lambda: answered(lease.time_to_live, client, lease_id), what="the lease's TTL")
    assert left is not None and left > 0, f"lease {lease_id:x} expired"
    return time.monotonic() + left


def test_holder_and_waiter_survive_the_loss_of_their_member(
    cluster: EtcdCluster, tmp_path: Path, gate: Gate, name: str
) -> None:
    runner = cluster_runner(cluster, tmp_path)
    try:
        holder = runner.start("sema", name, "--max", "1", "--ttl", "3s", "--", *gate.cmd("h"))
        poll(lambda: gate.now_running() == {"h"}, what="holder")
        waiter = runner.start("sema", name, "--max", "1", "--ttl", "3s", "--", *gate.cmd("w"))
        with cluster.client() as client:
            poll(lambda: len(sema_keys(client, name)) == 2, what="waiter queued")
        cluster.members[0].stop()  # everyone talks to the first endpoint
        # Both leases are kept alive through another member: each one's expiry moves on.
        with Client.connect([e for e in cluster.client().endpoints[1:]], dial_timeout=5) as client:
            held = poll(lambda: answered(sema_keys, client, name), what="keys read")
            leases = [k.lease for k in held or []]
            # After any election: a new leader gives every lease a fresh TTL once, itself.
            floors = {lease_id: expiry_floor(client, lease_id) for lease_id in leases}
            poll(
                lambda: all(expiry_floor(client, i) > floors[i] + 1 for i in leases),
                what="keepalives of the holder and the waiter through another member",
            )
            assert gate.now_running() == {"h"}
            assert len(sema_keys(client, name)) == 2
            gate.release("h")
            poll(lambda: gate.now_running() == {"w"}, what="waiter promoted after failover")
            gate.release("w")
        assert holder.wait() == 0 and waiter.wait() == 0
        assert "lost" not in holder.events()
    finally:
        runner.cleanup()


def test_waiter_whose_member_hangs_still_gets_the_slot(cluster: EtcdCluster, name: str) -> None:
    """A member that hangs (SIGSTOP) closes no connection: the waiter's watch on it goes
    silent. Its progress probe must move it to another member in time to see the release."""
    endpoints = [Endpoint.parse(e) for e in cluster.endpoints.split(",")]
    holder_client = Client.connect(endpoints[1:], dial_timeout=5)
    waiter_client = Client.connect(endpoints, dial_timeout=5)  # talks to member 0 first
    holder = Semaphore(holder_client, name, 1, ttl=5).acquire(timeout=10)
    result: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "hold", Semaphore(waiter_client, name, 1, ttl=5).acquire(90)
        ),
        daemon=True,
    )
    thread.start()
    poll(lambda: len(sema_keys(holder_client, name)) == 2, what="the waiter queued")
    cluster.members[0].pause()
    try:
        member = cluster.members[0].process
        assert member is not None
        pid = member.pid
        # SIGSTOP has taken effect: the member is silent from here on, the release comes after.
        poll(lambda: (stat_fields(pid) or [""])[0] == "T", what="member 0 stopped")
        released = time.monotonic()
        holder.release()
        thread.join(60)
        took = time.monotonic() - released
        print(f"\n[measure] waiter on a hung member -> slot after the release: {took:.1f}s")
        hold = result.get("hold")
        assert hold is not None, "the waiter never saw the release"
        # Probe after 10 s of silence, 5 s for an answer, then resume elsewhere; without the
        # probe this took 41-65 s (gRPC keepalive giving up).
        assert took < 30
        hold.release()  # type: ignore[attr-defined]
    finally:
        cluster.members[0].resume()
        holder_client.close()
        waiter_client.close()


def test_quorum_loss_kills_holders_and_waiters_get_slots_when_it_returns(
    cluster: EtcdCluster,
    tmp_path: Path,
    gate: Gate,
    name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runner = cluster_runner(cluster, tmp_path)
    try:
        holder = runner.start("sema", name, "--max", "1", "--ttl", "3s", "--", *gate.cmd("h"))
        poll(lambda: gate.now_running() == {"h"}, what="holder")
        waiter = runner.start(
            "sema", name, "--max", "1", "--ttl", "3s", "--wait", "5m", "--", *gate.cmd("w")
        )
        with cluster.client() as client:
            poll(lambda: len(sema_keys(client, name)) == 2, what="waiter queued")
        cluster.members[1].stop()
        cluster.members[2].stop()
        began = time.monotonic()  # quorum is gone once the second member has exited
        poll(lambda: "h" not in gate.now_running(), timeout=30, what="holder's child stopped")
        detected = time.monotonic() - began
        assert holder.wait(timeout=30) == 70
        # Loss is declared within about one keepalive interval (1 s) plus the margin and
        # the failover attempts; generous bound for a noisy machine.
        assert detected < 10, detected
        with capsys.disabled():
            print(f"\n[measure] quorum loss -> child SIGTERMed: {detected:.2f}s (TTL 3s)")
        # Observation window of one keepalive interval (TTL/3): nothing runs without quorum.
        time.sleep(1)
        assert gate.now_running() == set()
        assert "event=acquired" not in waiter.log()
        for member in cluster.members[1:]:
            member.start(cluster.initial_cluster)
        poll(lambda: gate.now_running() == {"w"}, timeout=60, what="waiter promoted")
        gate.release("w")
        assert waiter.wait() == 0
    finally:
        runner.cleanup()


def test_watch_resumes_on_another_member_without_losing_or_repeating_events(
    cluster: EtcdCluster,
) -> None:
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    with (
        cluster.client() as client,
        Client.connect([Endpoint.parse(m.endpoint) for m in cluster.members[1:]]) as other,
    ):
        start = kv.put(client, b"/resume/k", b"0").header.revision
        watch = Watch(client, b"/resume/k", start, box.put)
        try:
            first = box.get(timeout=30)
            assert [e.kv.value for e in first.events] == [b"0"]
            cluster.members[0].stop()  # the member the watch stream is on
            # If it led, the others elect a new leader first: seconds on a loaded machine
            # (a 5 s request timeout ran out once in CI on etcd 3.4).
            kv.put(other, b"/resume/k", b"1", timeout=DEADLINE)
            kv.put(other, b"/resume/k", b"2")
            kv.delete(other, b"/resume/k")
            seen: list[tuple[int, bytes]] = []
            while len(seen) < 3:
                notice = box.get(timeout=30)
                assert notice.error is None, notice.error
                seen.extend((e.type, e.kv.value) for e in notice.events)
            assert seen == [(Event.PUT, b"1"), (Event.PUT, b"2"), (Event.DELETE, b"")]
            with pytest.raises(queue.Empty):
                box.get(timeout=1.0)  # nothing repeated
        finally:
            watch.cancel()


# -- the whole etcd stops ------------------------------------------------------------------


def test_whole_etcd_outage_fails_closed_within_the_ttl(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    single = EtcdCluster(tmp_path / "solo", size=1)
    single.start()
    runner = Runner(single, tmp_path)
    marker = tmp_path / "termed"
    script = (
        f"trap 'date +%s.%N > {marker}; exit 0' TERM; touch {tmp_path}/up; "
        "while :; do sleep 0.05; done"
    )
    try:
        proc = runner.start("sema", name, "--max", "1", "--ttl", "6s", "--", "sh", "-c", script)
        poll(lambda: (tmp_path / "up").exists(), what="child up")
        outage_began = time.time()
        single.members[0].pause()
        assert proc.wait(timeout=30) == 70
        to_sigterm = float(marker.read_text()) - outage_began
        with capsys.disabled():
            print(f"\n[measure] whole-etcd outage -> SIGTERM to child: {to_sigterm:.2f}s (TTL 6s)")
        assert to_sigterm < 6.0
    finally:
        single.members[0].resume()
        runner.cleanup()
        single.stop()


def _sigterm_to_a_waiter_of_a_dead_etcd(
    tmp_path: Path, name: str, ttl: str, broken: Callable[[str], bool], past: float
) -> float:
    """Queue a waiter (lease TTL ``ttl``) behind a holder, stop etcd (refused connections:
    each attempt of a retrying call fails at once), wait until ``broken(waiter's log)``
    and until ``past`` seconds after the stop, then SIGTERM it: it must exit 128 + 15.
    Returns how long it took to, in seconds."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    runner = Runner(solo, tmp_path)
    gate = Gate(tmp_path)
    try:
        holder = runner.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
        poll(lambda: gate.now_running() == {"h"}, what="holder running")
        waiter = runner.start("sema", name, "--max", "1", "--ttl", ttl, "--", "true")
        poll(lambda: "event=queued" in waiter.log(), what="waiter queued")
        solo.members[0].stop()
        stopped = time.monotonic()
        poll(lambda: broken(waiter.log()), timeout=30, what="the waiter retrying")
        # Observation window: the waiter retries on, this long after the stop.
        time.sleep(max(0.0, stopped + past - time.monotonic()))
        sent = time.monotonic()
        waiter.signal(signal.SIGTERM)
        assert waiter.wait() == 128 + signal.SIGTERM, waiter.log()
        assert "event=requeue" not in waiter.log()  # its lease may live on: its place too
        holder.kill()
        return time.monotonic() - sent
    finally:
        runner.cleanup()
        solo.stop()


def test_a_waiter_of_a_dead_etcd_past_its_ttl_keeps_its_place_and_stops_at_once_on_sigterm(
    tmp_path: Path, name: str
) -> None:
    """Queued, etcd gone: the waiter's reads retry ("etcd-away"), and past its 3 s TTL it
    still does not re-enter (only etcd saying the lease is gone would make it), so no
    LeaseGrant is tried against a dead etcd; SIGTERM in the middle of those retries ends it
    at once (it used to wait them out)."""
    took = _sigterm_to_a_waiter_of_a_dead_etcd(  # past every expiry its lease had: 3 s
        tmp_path, name, "3s", lambda log: "event=etcd-away" in log, 3.2
    )
    assert took < 2.0


def test_a_waiter_rereading_the_queue_against_a_dead_etcd_stops_at_once_on_sigterm(
    tmp_path: Path, name: str
) -> None:
    """Queued, etcd gone: the waiter's watch breaks ("rewatch") and it reads the queue
    again, a read that retries for the request timeout (5 s), or its session goes first and
    it retries a LeaseGrant. SIGTERM then used to wait for either to give up."""
    took = _sigterm_to_a_waiter_of_a_dead_etcd(
        tmp_path, name, "10s", lambda log: "event=rewatch" in log or "event=requeue" in log, 0
    )
    assert took < 2.5


@pytest.mark.alone
def test_a_client_is_back_within_seconds_of_the_end_of_a_long_outage(tmp_path: Path) -> None:
    """gRPC's reconnect backoff would have grown to ~10 s over a 20 s outage (the client came
    back 4-7 s after etcd did; 10-15 s after a 30 s outage)."""
    solo = EtcdCluster(tmp_path / "solo", size=1)
    solo.start()
    member = solo.members[0]
    try:
        with Client.connect(solo.client().endpoints, dial_timeout=5) as client:
            kv.put(client, b"/outage", b"before")
            member.stop()
            outage_ends = time.monotonic() + 20  # the outage itself, not a wait for an event
            while time.monotonic() < outage_ends:  # a client in use keeps reconnecting
                with contextlib.suppress(EtcdError):
                    kv.get(client, b"/outage", timeout=0.5)
                time.sleep(0.5)  # the pace of the client's use, part of the scenario
            member.start(solo.initial_cluster, "existing")
            # etcd's own client says when it is back (ours share gRPC's subchannels, and so
            # their backoff, whatever their channel).
            health = [etcdctl_binary(), "--endpoints", member.endpoint, "endpoint", "health"]
            poll(
                lambda: subprocess.run(health, capture_output=True, timeout=10).returncode == 0,
                timeout=30,
                what="etcd back",
            )
            back = time.monotonic()

            def answers() -> bool:
                with contextlib.suppress(EtcdError):
                    return kv.get(client, b"/outage", timeout=0.5) is not None
                return False

            poll(answers, timeout=30, what="our client answered")
            print(f"\n[measure] client back {time.monotonic() - back:.2f}s after etcd")
            assert time.monotonic() - back < 2.5
    finally:
        solo.stop()


# -- compaction ----------------------------------------------------------------------------


def test_waiter_whose_watch_start_was_compacted_still_gets_the_slot(
    client: Client, proxies: Callable[[], FaultProxy], name: str
) -> None:
    """etcd compacted past the revision a waiter just read, before its watch started: the
    race a busy cluster with auto-compaction produces now and then, made certain by churning
    and compacting before etcd's answer to the waiter's first standing read goes on."""
    holder_sema = Semaphore(client, name, 1, ttl=5, identity=Identity.current(["h"]))
    hold = holder_sema.acquire(timeout=10)
    proxy = proxies()
    compacted = threading.Event()

    def compact_first(answer: rpc_pb2.RangeResponse | rpc_pb2.TxnResponse, context: object) -> None:
        # The standing read: a Range, or a read-only Txn of Ranges (the enqueue and the
        # touch put).
        reads = isinstance(answer, rpc_pb2.RangeResponse) or all(
            r.HasField("response_range") for r in answer.responses
        )
        if compacted.is_set() or not reads:
            return
        for i in range(3):
            kv.put(client, b"/churn/" + str(i).encode(), b"x")
        now = kv.put(client, b"/churn/last", b"x").header.revision
        client.call("kv", "Compact", rpc_pb2.CompactionRequest(revision=now))
        compacted.set()

    got: list[int] = []
    with proxy.client() as waiter_client:
        waiter = Semaphore(waiter_client, name, 1, ttl=5, identity=Identity.current(["w"]))
        thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30).revision))
        # Behind two other keys: its enqueue reads where it stands (a Txn that also puts);
        # once they go, it reads its standing again, and that read is compacted past.
        with other_keys(client, name, 1, 2):
            thread.start()
            poll(lambda: len(sema_keys(client, name)) == 4, what="the waiter queued")
            proxy.after("Range", compact_first)
            proxy.after("Txn", compact_first)
        poll(compacted.is_set, what="the compaction to be injected")
        hold.release()
        thread.join(timeout=30)
    assert got and got[0] > hold.revision


def test_no_slot_stays_free_while_a_waiter_waits_under_compaction_and_churn(
    tmp_path: Path, name: str, gate: Gate
) -> None:
    busy = EtcdCluster(
        tmp_path / "busy",
        size=1,
        extra=["--auto-compaction-mode=revision", "--auto-compaction-retention=10"],
    )
    busy.start()
    runner = Runner(busy, tmp_path)
    stop = threading.Event()

    def churn() -> None:
        with busy.client() as c:
            i = 0
            while not stop.is_set():
                rev = kv.put(c, b"/churn/k", str(i).encode()).header.revision
                if i % 20 == 0:
                    c.call("kv", "Compact", rpc_pb2.CompactionRequest(revision=rev))
                i += 1
                stop.wait(0.005)

    churner = threading.Thread(target=churn)
    churner.start()
    log = tmp_path / "spans"
    script = f'echo "start $(date +%s.%N)" >> {log}; sleep 0.3; echo "end $(date +%s.%N)" >> {log}'
    try:
        with busy.client() as client:
            procs = [runner.start("sema", name, "--max", "1", "--", *gate.cmd("first"))]
            poll(lambda: gate.now_running() == {"first"}, what="first holder")
            for _ in range(5):
                procs.append(runner.start("sema", name, "--max", "1", "--", "sh", "-c", script))
                poll(lambda: len(sema_keys(client, name)) == len(procs), what="queued")
            gate.release("first")
            assert [p.wait(timeout=60) for p in procs] == [0] * 6
        lines = [line.split() for line in log.read_text().splitlines()]
        # Every waiter was queued before the first slot freed: each handoff must be quick.
        assert [kind for kind, _ in lines] == ["start", "end"] * 5
        stamps = [float(t) for _, t in lines]
        gaps = [stamps[i + 1] - stamps[i] for i in range(1, len(stamps) - 1, 2)]
        assert max(gaps) < 1.0, gaps
    finally:
        stop.set()
        churner.join()
        runner.cleanup()
        busy.stop()


# -- hostile state under the prefix ------------------------------------------------------


def test_hostile_keys_are_shown_marked_and_occupy_their_place(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    base = f"/conch/v1/sema/{name}/".encode()
    kv.put(client, base + b"1/zzz", b"not json")  # no lease, bad value
    kv.put(client, base + b"abc/x", b"{}")  # capacity that is not a number
    kv.put(client, base + b"1", b"[1,2]")  # no tail at all
    records = who_json(conch, name)
    notes = {str(r["note"]) for r in records}
    assert any("malformed-value" in n and "no-lease" in n for n in notes), records
    assert any("bad-key" in n for n in notes), records
    # The unleased key holds the only slot of --max 1 ...
    code, _, err = conch.run("sema", name, "--max", "1", "--nonblock", "--", "true")
    assert code == 75 and "Traceback" not in err
    # ... and counts as one holder of --max 2.
    proc = conch.start("sema", name, "--max", "2", "--", *gate.cmd("ok"))
    poll(lambda: gate.now_running() == {"ok"}, what="second slot of --max 2")
    gate.release("ok")
    assert proc.wait() == 0
    kv.delete(client, base, kv.prefix_end(base))
    assert conch.run("sema", name, "--max", "1", "--nonblock", "--", "true")[0] == 0


def test_interrupt_flag_set_by_a_signal_handler_withdraws_a_library_waiter(
    client: Client, name: str
) -> None:
    holder = Semaphore(client, name, 1, ttl=5).acquire(timeout=10)
    interrupt = Flag("interrupt")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            Semaphore(client, name, 1, ttl=5).acquire(interrupt=interrupt)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    poll(lambda: len(sema_keys(client, name)) == 2, what="library waiter queued")
    interrupt.set(signal.SIGINT)
    thread.join(timeout=30)
    assert errors and getattr(errors[0], "exit_code", None) == 128 + signal.SIGINT
    assert len(sema_keys(client, name)) == 1
    holder.release()
    assert sema_keys(client, name) == []
