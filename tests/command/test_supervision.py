"""The supervision against real etcd: every fatal signal, what the child leaves behind outside
its process group, and a hold lost before the child starts."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conch.errors import NoSlot
from conch.etcd import Client, lease
from conch.flag import Flag
from conch.hold import Hold
from conch.semaphore import Semaphore
from conch.session import Session
from conch.supervisor import supervise
from tests.command.test_sema import DEFAULT_SIGNALS, _ignored
from tests.conftest import DEADLINE, Gate, Runner, alive, poll, sema_keys
from tests.faults.test_failures import read_pid, reaped_at_the_end

# The signals whose default action ends a process that conch handled as anything but that
# (INT, TERM and HUP are covered in test_sema): the named ones and both ends of the real-time
# range.
FATAL_SIGNALS = [
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,
    signal.SIGPWR,
    signal.SIGSTKFLT,
    signal.SIGXCPU,
    signal.SIGRTMIN,
    signal.SIGRTMAX,
]


def test_every_fatal_signal_to_a_queued_conch_withdraws_and_exits_128_plus_it(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    """SIGQUIT (^\\), SIGUSR1, SIGALRM and the like killed a queued conch outright, leaving
    its key in etcd until the lease's TTL ran out. Each now withdraws, as SIGTERM does."""
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    waiters = {
        sig: conch.start("sema", name, "--max", "1", "--", "true", launcher=DEFAULT_SIGNALS)
        for sig in FATAL_SIGNALS
    }
    poll(lambda: len(sema_keys(client, name)) == 1 + len(waiters), what="every waiter queued")
    for sig, waiter in waiters.items():
        waiter.signal(sig)
    codes = {sig: waiter.wait() for sig, waiter in waiters.items()}
    assert codes == {sig: 128 + sig for sig in FATAL_SIGNALS}
    assert len(sema_keys(client, name)) == 1, "a waiter left its key behind"
    for sig, waiter in waiters.items():
        assert f"event=interrupted name={name} signum={int(sig)}" in waiter.log()
    gate.release("h")
    assert holder.wait() == 0


@pytest.mark.parametrize("sig", [signal.SIGQUIT, signal.SIGRTMIN])
def test_a_fatal_signal_to_a_running_conch_terminates_the_child_and_releases(
    conch: Runner, client: Client, name: str, tmp_path: Path, sig: int
) -> None:
    """As SIGTERM: the child's group gets SIGTERM, conch releases and exits with the child's
    status (contract section 7)."""
    up, marker = tmp_path / "up", tmp_path / "trapped"
    script = f"trap 'echo term > {marker}; exit 42' TERM; touch {up}; while :; do sleep 0.05; done"
    # Started with every signal at its default: a test worker may have SIGQUIT ignored by
    # then, and conch keeps a signal ignored by whoever started it (nohup, a background job).
    proc = conch.start(
        "sema", name, "--max", "1", "--", "sh", "-c", script, launcher=DEFAULT_SIGNALS
    )
    poll(up.exists, what="child up")
    proc.signal(sig)
    assert proc.wait() == 42, proc.log()
    assert marker.read_text().strip() == "term"
    assert sema_keys(client, name) == []
    events = proc.events()
    assert events.index("signal") < events.index("term-sent") < events.index("released")


def test_fatal_signals_ignored_by_whoever_started_conch_stay_ignored(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """A script's background job ignores SIGQUIT as it does SIGINT; whatever is ignored when
    conch starts neither stops conch nor reaches the child as anything but ignored."""
    up, status = tmp_path / "up", tmp_path / "status"
    script = f"cat /proc/self/status > {status}; touch {up}; while :; do sleep 0.05; done"
    ignoring = ["sh", "-c", "trap '' QUIT USR1; exec \"$@\"", "sh"]
    launcher = [*DEFAULT_SIGNALS, *ignoring]
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script, launcher=launcher)
    poll(up.exists, what="child up")
    assert _ignored(status.read_text()) == (1 << (signal.SIGQUIT - 1)) | (1 << (signal.SIGUSR1 - 1))
    for sig in (signal.SIGQUIT, signal.SIGUSR1, signal.SIGTERM):
        proc.signal(sig)
    assert proc.wait() == 128 + signal.SIGTERM
    assert f"event=signal signum={int(signal.SIGTERM)} " in proc.log()


def test_signals_blocked_by_whoever_started_conch_still_stop_it(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """A parent that blocks signals (the mask survives exec) and starts conch: SIGTERM and
    SIGQUIT used to stay pending for good, conch and its child running on, deaf to them."""
    up = tmp_path / "up"
    script = f"touch {up}; while :; do sleep 0.05; done"
    blocking = [
        sys.executable,
        "-c",
        "import os, signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGQUIT})\n"
        "os.execvp(sys.argv[1], sys.argv[1:])",
    ]
    launcher = [*DEFAULT_SIGNALS, *blocking]  # at their default but blocked, as said above
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script, launcher=launcher)
    poll(up.exists, what="child up")
    proc.signal(signal.SIGQUIT)
    assert proc.wait() == 128 + signal.SIGTERM, proc.log()
    assert f"event=signal signum={int(signal.SIGQUIT)} " in proc.log()


# -- a hold lost before the child starts -------------------------------------------------------


class LostOnce(Semaphore):
    """A semaphore whose first hold is lost right after its acquisition, before the child
    starts: its lease revoked from outside, and the session has noticed."""

    rounds = 0

    def acquire(
        self,
        timeout: float | None = None,
        interrupt: Flag | None = None,
        session: Session | None = None,
        *,
        guard: bool = True,
    ) -> Hold:
        hold = super().acquire(timeout, interrupt, session, guard=guard)
        LostOnce.rounds += 1
        if LostOnce.rounds == 1:
            lease.revoke(self.client, hold.lease_id)
            assert hold.lost.wait(DEADLINE), "the session did not notice the revoke"
        return hold


def test_a_hold_lost_before_the_child_starts_requeues_and_the_child_runs(
    client: Client, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter whose session died as it reached the front logged acquired, then lost, and
    exited 70 without ever running its command. Nothing ran: it queues again instead."""
    LostOnce.rounds = 0
    caplog.set_level(logging.INFO, logger="conch")
    marker = tmp_path / "ran"
    sema = LostOnce(client, name, max=1, ttl=3)
    assert supervise(sema, ["touch", str(marker)], 20.0, 1.0, Flag("stop")) == 0
    assert LostOnce.rounds == 2 and marker.exists()
    assert "event=requeue" in caplog.text and "before the child started" in caplog.text
    assert sema_keys(client, name) == []


def test_a_hold_lost_before_the_child_starts_with_no_wait_left_is_no_slot(
    client: Client, name: str, tmp_path: Path
) -> None:
    """--nonblock (or a --wait run out): the lost hold is no slot (exit 75), not a loss
    while the child ran (70); the child never starts and nothing is left in etcd."""
    LostOnce.rounds = 0
    marker = tmp_path / "ran"
    sema = LostOnce(client, name, max=1, ttl=3)
    with pytest.raises(NoSlot) as raised:
        supervise(sema, ["touch", str(marker)], 0.0, 1.0, Flag("stop"))
    assert raised.value.exit_code == 75
    assert LostOnce.rounds == 1 and not marker.exists()
    assert sema_keys(client, name) == []


# -- what the child leaves outside its process group -------------------------------------------


def escaping(script: str, pidfile: Path, wait: bool) -> str:
    """A child that starts ``script`` in a session of its own (``setsid``, out of the child's
    process group) and, once ``pidfile`` is written, exits (or, if ``wait``, runs on)."""
    quoted = script.replace("'", "'\\''")
    then = "while :; do sleep 0.05; done" if wait else "exit 0"
    return f"setsid sh -c '{quoted}' & while [ ! -s {pidfile} ]; do sleep 0.01; done; {then}"


def write_pid(pidfile: Path) -> str:
    return f"echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}"


def escaped_line(log: str, pid: int) -> str:
    return next(
        (line for line in log.splitlines() if "event=escaped" in line and f" pid={pid} " in line),
        "",
    )


def test_a_process_that_left_the_group_keeps_the_slot_until_it_is_gone(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """A child that starts ``setsid ... &`` and exits: conch released the slot at once and the
    next holder ran beside the escaped process. The escaped process counts as the child: it
    is named in a warning, sent SIGTERM (this one ignores it), and the slot stays held until
    it is gone; the next holder starts only after that."""
    pidfile, gate, order = tmp_path / "escaped", tmp_path / "gate", tmp_path / "order"
    script = (
        f"trap '' TERM; {write_pid(pidfile)}; "
        f"while [ ! -e {gate} ]; do sleep 0.02; done; echo escaped-gone >> {order}"
    )
    holder = conch.start(
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
        escaping(script, pidfile, wait=False),
    )
    with reaped_at_the_end(pidfile):
        escaped = read_pid(pidfile)
        poll(lambda: "event=child-exit" in holder.log(), what="the child's exit")
        waiter = conch.start("sema", name, "--max", "1", "--", "sh", "-c", f"echo next >> {order}")
        poll(lambda: "event=queued" in waiter.log() or order.exists(), what="the next holder")
        assert alive(escaped)
        gate.touch()
        assert waiter.wait() == 0, waiter.log()
        assert order.read_text().split() == ["escaped-gone", "next"]
        assert "cmd=" in escaped_line(holder.log(), escaped)
        assert holder.log().count("event=escaped") == 1, "something else named (the watchdog?)"
        assert holder.wait() == 0, holder.log()
        assert "kill-sent" not in holder.events()


@pytest.mark.parametrize("end", ["loss", "signal"])
def test_a_process_that_left_the_group_is_terminated_with_it_on_a_loss_or_signal(
    conch: Runner, client: Client, name: str, tmp_path: Path, end: str
) -> None:
    """The child runs on with a ``setsid``'d process of its own: on a loss or a stop signal
    that process is terminated with the group (its parent, dying of SIGTERM, leaves it to
    conch), not left running after the release."""
    pidfile = tmp_path / "escaped"
    script = f"{write_pid(pidfile)}; exec sleep 600"
    proc = conch.start(
        "sema",
        name,
        "--max",
        "1",
        "--ttl",
        "20s",
        "--kill-after",
        "10s",
        "--",
        "sh",
        "-c",
        escaping(script, pidfile, wait=True),
    )
    with reaped_at_the_end(pidfile):
        escaped = read_pid(pidfile)
        if end == "loss":
            lease.revoke(client, sema_keys(client, name)[0].lease)
        else:
            proc.signal(signal.SIGTERM)
        assert proc.wait() == (70 if end == "loss" else 128 + signal.SIGTERM), proc.log()
        assert not alive(escaped), "the escaped process outlived conch"
        assert escaped_line(proc.log(), escaped)
        assert proc.log().count("event=escaped") == 1, "something else named (the watchdog?)"
        assert sema_keys(client, name) == []
        # A loss seen in etcd (the lease revoked) gets no grace: SIGKILL at once.
        assert ("kill-sent" in proc.events()) == (end == "loss")


def test_a_double_forked_process_keeps_the_slot_until_it_is_terminated(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """A daemon's double fork: a subshell starts ``setsid sleep`` and exits at once, so the
    sleep is re-parented to conch while the child still runs. When the child exits, the
    sleep is terminated and the slot released only after it is gone."""
    pidfile = tmp_path / "escaped"
    proc = conch.start(
        "sema", name, "--max", "1", "--ttl", "20s", "--kill-after", "10s",
        "--", "sh", "-c", double_fork(pidfile),
    )  # fmt: skip
    with reaped_at_the_end(pidfile):
        escaped = read_pid(pidfile)
        poll(lambda: not sema_keys(client, name), what="the slot released")
        assert not alive(escaped), "the slot was released while the escaped process ran"
        assert proc.wait() == 5, proc.log()
        events = proc.events()
        assert events.index("escaped") < events.index("term-sent") < events.index("released")
        assert escaped_line(proc.log(), escaped), proc.log()


def double_fork(pidfile: Path) -> str:
    """A child whose subshell starts ``setsid sleep`` and exits at once; the child exits 5
    once the sleep has been re-parented to conch (the child's parent)."""
    parent_of_escaped = f"$(cut -d' ' -f4 /proc/$(cat {pidfile})/stat)"
    return (
        f"(setsid sh -c '{write_pid(pidfile)}; exec sleep 600' &); "
        f'while [ ! -s {pidfile} ] || [ "{parent_of_escaped}" != "$PPID" ]; do sleep 0.01; done; '
        "exit 5"
    )


# Runs conch (its command line as the arguments) in a mount namespace of its own where its
# /proc/PID/task is an empty tmpfs: the children files of its threads are not there, as on
# a kernel without CONFIG_PROC_CHILDREN, so it lists its children by a scan of /proc.
WITHOUT_CHILDREN_FILES = (
    "unshare", "-m", "sh", "-c", 'mount -t tmpfs none "/proc/$$/task" && exec "$@"', "sh",
)  # fmt: skip


def test_both_ways_of_listing_our_children_find_the_double_forked_process(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    """The children files of conch's threads (where the kernel has them) and a scan of every
    /proc/PID/stat (where it does not) both find the orphan of a double fork re-parented to
    conch: it is named in an ``escaped`` warning, terminated, and the slot is released only
    after it is gone."""
    if not Path(f"/proc/self/task/{os.getpid()}/children").exists():
        pytest.skip("no /proc/PID/task/TID/children here (CONFIG_PROC_CHILDREN)")
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("hiding the children files takes a mount namespace (root, unshare)")
    for way, launcher in (("children files", ()), ("/proc scan", WITHOUT_CHILDREN_FILES)):
        pidfile = tmp_path / f"escaped-{len(launcher)}"
        proc = conch.start(
            "sema", name, "--max", "1", "--ttl", "20s", "--kill-after", "10s",
            "--", "sh", "-c", double_fork(pidfile), launcher=launcher,
        )  # fmt: skip
        with reaped_at_the_end(pidfile):
            escaped = read_pid(pidfile)
            hidden = Path(f"/proc/{proc.pid}/mountinfo").read_text()
            assert (f"/proc/{proc.pid}/task " in hidden) == bool(launcher), way
            poll(lambda: not sema_keys(client, name), what=f"the slot released ({way})")
            assert not alive(escaped), (
                f"the slot was released while the escaped process ran ({way})"
            )
            assert proc.wait() == 5, proc.log()
            assert escaped_line(proc.log(), escaped), (way, proc.log())


# A subreaper whose reaper has found no child yet starts one that exits at once, and prints
# how long its exit took to reach the callback, GROUP_POLL set far above any scheduling delay.
FIRST_CHILD = """
import queue, sys, threading, time
from conch import procs as supervisor
supervisor.GROUP_POLL = 15.0
assert supervisor.adopt_orphans()
reaper = next(t for t in threading.enumerate() if t.name == "conch-reap")
def idle():  # the reaper has looked, found no child and waits (GROUP_POLL) to look again
    frame = sys._current_frames().get(reaper.ident)
    while frame is not None and frame.f_code.co_name != "wait":
        frame = frame.f_back
    return frame is not None
deadline = time.monotonic() + 20
while not idle():
    assert time.monotonic() < deadline, "the reaper never looked"
    time.sleep(0.01)
box = queue.SimpleQueue()
with supervisor._reap_lock:
    pid = supervisor.spawn(["true"], {})
    started = time.monotonic()
    supervisor._on_exit(pid, box.put)
box.get(timeout=60)
print(time.monotonic() - started, flush=True)
"""


def test_the_reaper_notices_a_first_child_at_once() -> None:
    """The adopting reaper, started before this process had any child, looks again as soon
    as one is started instead of after GROUP_POLL (the command's child waited for the end of
    that 50 ms poll to be noticed)."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_CHILD], capture_output=True, text=True, timeout=DEADLINE
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 7.5, "the child's exit waited for the reaper's poll"


REAPER_SURVIVES = """
import os, sys, threading
from conch import procs as supervisor
assert supervisor.adopt_orphans()
raised, done = threading.Event(), threading.Event()

def raising(status):
    raised.set()
    raise RuntimeError("an exit callback's bug")

for callback in (raising, lambda status: done.set()):
    with supervisor._reap_lock:
        pid = supervisor.spawn(["true"], dict(os.environ))
        supervisor._on_exit(pid, callback)
    if callback is raising and not raised.wait(20):  # reaped, its callback run (and raising)
        print("the first child was never reaped", flush=True)
        sys.exit(1)
print("reaped" if done.wait(20) else "the reaper died", flush=True)
"""


def test_the_reaper_survives_an_exit_callback_that_raises() -> None:
    """One child's exit callback that raises must not end the reaping thread: every later
    child would go unreaped, its exit unseen, its slot held until --kill-after."""
    result = subprocess.run(
        [sys.executable, "-c", REAPER_SURVIVES], capture_output=True, text=True, timeout=DEADLINE
    )
    assert result.stdout.strip() == "reaped", result.stderr
    assert "event=callback-failed" in result.stderr


# Runs conch with a fault of its own right after the child's start, where a test cannot
# reach into the process otherwise: through conch's public log function (conch.log.info),
# which raises at the "child-start" event once the child has said it runs. Used as
# Runner.start's launcher, it gets the command line that would run conch ("python -m conch
# ARGS") as its arguments.
FAULTY = """
import os, sys, time
from conch import cli, log

said = log.info

def injected(event, **fields):
    if event != "child-start":
        return said(event, **fields)
    deadline = time.monotonic() + 30  # once the child has said it runs (a poll)
    while not os.path.exists(os.environ["FAULT_AFTER"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("injected fault")

log.info = injected
sys.argv = ["conch", *sys.argv[4:]]
cli.run()
"""


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_fault_of_conchs_own_exits_70_with_one_line_and_the_child_dead(
    conch: Runner, name: str, tmp_path: Path, debug: bool
) -> None:
    """An exception no part of conch expects, raised while the child runs: the child is
    SIGKILLed, the slot released, and conch exits 70 (EX_SOFTWARE) with one line naming the
    exception and how to see its traceback; with --debug, the traceback too. Before, the
    traceback was printed and conch exited 1, a code a caller could not tell from the
    child's own."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    pidfile = tmp_path / "child.pid"
    child_cmd = ["sh", "-c", f"echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}; sleep 600"]
    flags = ["-q", *(["--debug"] if debug else [])]
    proc = conch.start(
        "sema", name, "--max", "1", *flags, "--", *child_cmd,
        launcher=[sys.executable, str(script)], FAULT_AFTER=str(pidfile),
    )  # fmt: skip
    assert proc.wait() == 70
    child = int(pidfile.read_text())
    assert not alive(child), "the child outlived conch's failure"
    lines = proc.log().splitlines()
    last = lines[-1]
    assert "event=internal-error" in last and "RuntimeError: injected fault" in last, lines
    if debug:
        assert "Traceback (most recent call last)" in proc.log()
    else:
        assert lines == [last], lines  # one line, no traceback
        assert "rerun with --debug for the traceback" in last
    with conch.etcd.client() as client:
        assert sema_keys(client, name) == []
