"""conch sema end to end: real conch processes contending on a real etcd."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conch.etcd import Client, kv, lease
from tests.conftest import (
    Conch,
    Gate,
    Runner,
    alive,
    etcd_watchers,
    other_keys,
    poll,
    sema_keys,
    who_json,
)
from tests.etcd_server import EtcdCluster, free_port


def start_queue(
    conch: Runner, gate: Gate, name: str, max_holders: int, idents: list[str], client: Client
) -> list[Conch]:
    """Start one conch per ident, in order: each is queued (its key exists) before the next."""
    procs = []
    for ident in idents:
        procs.append(conch.start("sema", name, "--max", str(max_holders), "--", *gate.cmd(ident)))
        poll(
            lambda: len(sema_keys(client, name, max_holders)) == len(procs), what=f"{ident} queued"
        )
    return procs


def test_n_plus_one_contenders_leave_exactly_n_children_running(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    procs = [conch.start("sema", name, "--max", "2", "--", *gate.cmd(f"c{i}")) for i in range(3)]
    poll(lambda: len(gate.now_running()) == 2, what="two children running")
    waiter = ({"c0", "c1", "c2"} - gate.now_running()).pop()
    poll(lambda: "queued" in procs[int(waiter[1:])].events(), what="the third to decide to wait")
    time.sleep(0.25)  # observation window: nothing starts while both slots are held
    assert len(gate.now_running()) == 2
    states = [r["state"] for r in who_json(conch, name)]
    assert states == ["HELD", "HELD", "WAIT"]
    for ident in list(gate.now_running()):
        gate.release(ident)
    poll(lambda: waiter in gate.now_running(), what="the waiter to be promoted")
    gate.release(waiter)
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert sema_keys(client, name) == []


def test_a_release_promotes_exactly_the_next_waiter_by_revision(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    procs = start_queue(conch, gate, name, 1, ["h", "w1", "w2"], client)
    poll(lambda: gate.now_running() == {"h"}, what="the holder to run")
    poll(lambda: "queued" in procs[2].events(), what="w2 to decide to wait")
    gate.release("h")
    poll(lambda: gate.now_running() == {"w1"}, what="w1 to be promoted")
    time.sleep(0.25)  # observation window: w2 does not start too
    assert gate.now_running() == {"w1"}
    assert gate.rev("w1") > 0
    gate.release("w1")
    poll(lambda: gate.now_running() == {"w2"}, what="w2 to be promoted")
    gate.release("w2")
    assert [p.wait() for p in procs] == [0, 0, 0]


def test_a_queue_of_five_is_served_in_fifo_order_with_rising_fencing_tokens(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    idents = [f"q{i}" for i in range(5)]
    procs = start_queue(conch, gate, name, 1, idents, client)
    revs = []
    for ident in idents:
        poll(lambda: gate.now_running() == {ident}, what=f"{ident} to run alone")  # noqa: B023
        revs.append(gate.rev(ident))
        gate.release(ident)
    assert gate.start_order() == idents
    assert revs == sorted(revs) and len(set(revs)) == 5
    assert all(p.wait() == 0 for p in procs)


def test_holders_released_out_of_order_still_promote_the_first_waiter(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    # N=2: the design page's "watch rank r-N" would leave w waiting on h0 while h1's slot
    # is free. Release h1 (the later holder) first.
    procs = start_queue(conch, gate, name, 2, ["h0", "h1", "w"], client)
    poll(lambda: gate.now_running() == {"h0", "h1"}, what="both holders")
    gate.release("h1")
    poll(lambda: gate.now_running() == {"h0", "w"}, timeout=10, what="w to take h1's slot")
    gate.release("h0")
    gate.release("w")
    assert [p.wait() for p in procs] == [0, 0, 0]


def test_second_waiter_moves_up_when_the_first_is_promoted(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    procs = start_queue(conch, gate, name, 2, ["h0", "h1", "w0", "w1"], client)
    poll(lambda: gate.now_running() == {"h0", "h1"}, what="both holders")
    gate.release("h0")
    poll(lambda: gate.now_running() == {"h1", "w0"}, what="w0 promoted")
    gate.release("h1")  # w1 was watching w0; it must now notice h1's release
    poll(lambda: gate.now_running() == {"w0", "w1"}, timeout=10, what="w1 promoted")
    gate.release("w0")
    gate.release("w1")
    assert all(p.wait() == 0 for p in procs)


def test_max_1_and_max_10_of_one_name_do_not_interfere(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    one = conch.start("sema", name, "--max", "1", "--", *gate.cmd("one"))
    ten = conch.start("sema", name, "--max", "10", "--", *gate.cmd("ten"))
    poll(lambda: gate.now_running() == {"one", "ten"}, what="both to run")
    code, _, _ = conch.run("sema", name, "--max", "1", "--nonblock", "--", "true")
    assert code == 75
    gate.release("one")
    gate.release("ten")
    assert one.wait() == 0 and ten.wait() == 0


def test_names_a_and_a_slash_1_do_not_interfere(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    a = conch.start("sema", name, "--max", "1", "--", *gate.cmd("a"))
    a1 = conch.start("sema", f"{name}/1", "--max", "1", "--", *gate.cmd("a1"))
    poll(lambda: gate.now_running() == {"a", "a1"}, what="both names held at once")
    assert [r["name"] for r in who_json(conch, name)] == [name]
    assert [r["name"] for r in who_json(conch, f"{name}/1")] == [f"{name}/1"]
    gate.release("a")
    gate.release("a1")
    assert a.wait() == 0 and a1.wait() == 0


def test_nonblock_exits_75_at_once_and_leaves_no_key(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    began = time.monotonic()
    code, _, err = conch.run("sema", name, "--max", "1", "--nonblock", "--", "true")
    assert code == 75
    assert time.monotonic() - began < 10  # process start included; no waiting
    assert "event=timeout" in err
    assert len(sema_keys(client, name)) == 1
    gate.release("h")
    assert holder.wait() == 0


def test_wait_runs_out_with_75_and_removes_its_key(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    waiter = conch.start("sema", name, "--max", "1", "--wait", "1.5s", "--", "true")
    poll(lambda: len(sema_keys(client, name)) == 2, what="waiter queued")
    assert waiter.wait() == 75
    assert [f"{k.lease:x}" for k in sema_keys(client, name)] == [who_json(conch, name)[0]["lease"]]
    gate.release("h")
    assert holder.wait() == 0


@pytest.mark.parametrize(("script", "expected"), [("exit 7", 7), ("kill -TERM $$", 128 + 15)])
def test_child_exit_code_and_signal_pass_through(
    conch: Runner, client: Client, name: str, script: str, expected: int
) -> None:
    code, _, err = conch.run("sema", name, "--max", "1", "--", "sh", "-c", script)
    assert code == expected
    assert "event=released" in err
    assert sema_keys(client, name) == []


def test_released_is_logged_after_child_exit_even_for_instant_children(
    conch: Runner, name: str
) -> None:
    """The slot is revoked by the thread that reaps the child, possibly before the main
    thread has logged anything; the log still reads child-start, child-exit, released."""
    for round_ in range(8):
        procs = [
            conch.start("sema", f"{name}-{round_}-{i}", "--max", "1", "--", "true")
            for i in range(3)
        ]
        for proc in procs:
            assert proc.wait() == 0
            events = proc.events()
            order = [events.index(e) for e in ("child-start", "child-exit", "released")]
            assert order == sorted(order), events


def test_stop_signals_after_the_child_exited_do_not_replace_its_status(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """SIGTERMs keep arriving while conch winds down after its child (which ignores them)
    ended: conch forwards or ignores them, and always exits with the child's status,
    never killed by the signal. (The window where the old code died is about a
    millisecond; these attempts hit it in about half the runs.)"""
    for attempt in range(15):
        done = tmp_path / f"done-{attempt}"
        script = f"trap '' TERM; echo > {done}; exit 3"
        proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script)
        poll(lambda done=done: done.exists(), what="the child to finish")  # type: ignore[misc]
        while proc.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.signal(signal.SIGTERM)
            time.sleep(0.0002)  # the signals' pace: the scenario, not a wait
        assert proc.wait() == 3, proc.log()


def test_child_sees_its_environment(conch: Runner, name: str) -> None:
    code, out, _ = conch.run(
        "sema",
        name,
        "--max",
        "3",
        "--",
        "sh",
        "-c",
        'echo "$CONCH_NAME|$CONCH_REV|$CONCH_LEASE|$CONCH_MAX"',
    )
    assert code == 0
    got_name, rev, lease_hex, max_text = out.strip().split("|")
    assert (got_name, max_text) == (name, "3")
    assert int(rev) > 0 and int(lease_hex, 16) > 0


@pytest.mark.parametrize(
    ("argv0", "expected"), [("/nonexistent/cmd", 127), ("", 127), ("/dev/null", 126)]
)
def test_a_command_that_cannot_run_gives_126_or_127_and_frees_the_slot(
    conch: Runner, client: Client, name: str, argv0: str, expected: int
) -> None:
    code, _, err = conch.run("sema", name, "--max", "1", "--", argv0)
    assert code == expected
    assert "Traceback" not in err
    assert sema_keys(client, name) == []


def test_a_script_without_a_shebang_line_is_run_by_sh_as_execvp_does(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """flock(1) and timeout(1) start the command with execvp(3), which runs a file the kernel
    cannot execute (ENOEXEC: no #! line) with /bin/sh. A job moved from flock to conch runs
    the same way, named by path or found on PATH, with its arguments."""
    script = tmp_path / "job"
    script.write_text('echo "$0 ran with $1"\nexit 3\n')
    script.chmod(0o755)
    code, out, err = conch.run("sema", name, "--max", "1", "--", str(script), "one")
    assert (code, out) == (3, f"{script} ran with one\n"), err
    # An earlier "job" on PATH whose #! interpreter is missing gives ENOENT: execvp skips it,
    # and so must conch, rather than hand that file to sh.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "job").write_text("#!/nonexistent/interpreter\necho wrong file\n")
    (broken / "job").chmod(0o755)
    path = os.pathsep.join([str(broken), str(tmp_path), os.environ["PATH"]])
    code, out, err = conch.run("sema", name, "--max", "1", "--", "job", "two", PATH=path)
    assert (code, out) == (3, f"{script} ran with two\n"), err


# Runs its arguments with every signal at its default disposition (what a shell's background
# job, or the test runner's own caller, may have ignored is not ours to test here).
DEFAULT_SIGNALS = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for sig in signal.valid_signals():\n"
    "    try: signal.signal(sig, signal.SIG_DFL)\n"
    "    except (OSError, ValueError): pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


def _ignored(status: str) -> int:
    """The standard signals (1-31) ignored, as a mask, from a /proc/PID/status text."""
    line = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return int(line.split()[1], 16) & 0x7FFFFFFF


def test_child_starts_with_no_standard_signal_ignored(conch: Runner, name: str) -> None:
    """Python ignores SIGPIPE and SIGXFSZ; the child must not inherit that, or pipelines in it
    see EPIPE instead of dying by SIGPIPE. (Signals 32 and up: glibc's reserved signals, which
    its posix_spawn leaves ignored.)"""
    proc = conch.start(
        "sema", name, "--max", "1", "--", "cat", "/proc/self/status", launcher=DEFAULT_SIGNALS
    )
    assert proc.wait() == 0, proc.log()
    assert _ignored(proc.stdout()) == 0
    code, out, _ = conch.run("sema", name, "--max", "1", "--", "sh", "-c", "yes | head -1")
    assert code == 0 and out == "y\n"


def test_the_child_gets_the_environment_conch_was_started_with_plus_its_conch_variables(
    conch: Runner, name: str
) -> None:
    """As from cron: no LANG, no LC_*. Python coerces its own C locale (PEP 538: it sets
    LC_CTYPE=C.UTF-8 in its environment); the child must not inherit that."""
    started_with = {"PATH": os.environ["PATH"], "CONCH_ENDPOINTS": conch.etcd.endpoints}
    launcher = ["env", "-i", *(f"{k}={v}" for k, v in started_with.items())]
    proc = conch.start("sema", name, "--max", "1", "--", "env", launcher=launcher)
    assert proc.wait() == 0, proc.log()
    child = dict(line.split("=", 1) for line in proc.stdout().splitlines())
    assert set(child) == {*started_with, "CONCH_NAME", "CONCH_REV", "CONCH_LEASE", "CONCH_MAX"}
    assert {k: child[k] for k in started_with} == started_with
    # A C locale the caller asked for is coerced too: the child gets the caller's back.
    launcher = [*launcher, "LC_CTYPE=POSIX"]
    proc = conch.start("sema", name, "--max", "1", "--", "env", launcher=launcher)
    assert proc.wait() == 0, proc.log()
    assert "LC_CTYPE=POSIX" in proc.stdout().splitlines()


def test_sigint_or_sighup_ignored_by_whoever_started_conch_stays_ignored_but_not_sigterm(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """``nohup conch ...`` or a script's background job: SIGHUP and SIGINT must neither stop
    conch nor reach the child as anything but ignored, as with ``nohup CMD``. SIGTERM, even
    if ignored by the caller, is how conch stops the child: still handled, and at its
    default in the child. All three are sent at once; Python runs pending handlers lowest
    signal first, so a handled SIGHUP or SIGINT would be the one logged."""
    up, status = tmp_path / "up", tmp_path / "status"
    script = f"cat /proc/self/status > {status}; touch {up}; while :; do sleep 0.05; done"
    ignoring = ["sh", "-c", "trap '' HUP INT TERM; exec \"$@\"", "sh"]
    launcher = [*DEFAULT_SIGNALS, *ignoring]
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script, launcher=launcher)
    poll(up.exists, what="child up")
    assert _ignored(status.read_text()) == (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1))
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        os.kill(proc.pid, sig)
    assert proc.wait() == 128 + signal.SIGTERM
    assert f"event=signal signum={int(signal.SIGTERM)} " in proc.log()


def test_revoking_our_lease_sigkills_child_and_grandchild_at_once_and_exits_70(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 600 & echo $$ $! > {pids}; wait"
    proc = conch.start(
        "sema", name, "--max", "1", "--ttl", "4s", "--kill-after", "1.5s", "--", "sh", "-c", script
    )
    poll(lambda: pids.exists() and len(pids.read_text().split()) == 2, what="child and grandchild")
    child, grandchild = (int(p) for p in pids.read_text().split())
    lease.revoke(client, sema_keys(client, name)[0].lease)
    assert proc.wait() == 70
    for pid in (child, grandchild):
        poll(lambda: not alive(pid), timeout=10, what=f"pid {pid} gone")  # noqa: B023
    events = proc.events()
    # The slot may be someone else's already: no grace to spend beside its new holder.
    assert "lost" in events and "kill-sent" in events and "term-sent" not in events
    # the child's end is logged here too (contract section 9), before the release
    assert events.index("kill-sent") < events.index("child-exit") < events.index("released")
    assert f"pid={child} code={128 + signal.SIGKILL} " in proc.log()


def test_deleting_our_key_from_outside_counts_as_loss(
    conch: Runner, client: Client, name: str, gate: Gate
) -> None:
    from conch.etcd import kv

    proc = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    kv.delete(client, sema_keys(client, name)[0].key)
    assert proc.wait() == 70
    assert "our key was deleted" in proc.log()


def test_sigtstp_is_refused_conch_keeps_supervising_and_the_child_runs_on(
    conch: Runner, gate: Gate, name: str
) -> None:
    """^Z: a stopped conch sends no keepalives, and its child (in a session of its own, out
    of the terminal's reach) would run on unsupervised until the watchdog killed it. conch
    refuses the stop with a warning and goes on; the child is not stopped either."""
    proc = conch.start("sema", name, "--max", "1", "--", *gate.cmd("a"), launcher=DEFAULT_SIGNALS)
    poll(lambda: gate.now_running() == {"a"}, what="child running")
    proc.signal(signal.SIGTSTP)
    poll(lambda: "event=suspend-refused" in proc.log(), what="the refusal logged")
    state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "T", "conch stopped"
    gate.release("a")
    assert proc.wait() == 0, proc.log()
    assert "event=released" in proc.log()


def test_a_storm_of_sigtstp_is_refused_with_one_warning(
    conch: Runner, gate: Gate, name: str
) -> None:
    """Thousands of ^Z as fast as they come: each would run the handler, nested inside the
    last one's write, until a RecursionError escaped the supervision (the child ran on while
    the slot was released). One warning; conch supervises on and exits with the child's 0."""
    proc = conch.start("sema", name, "--max", "1", "--", *gate.cmd("a"), launcher=DEFAULT_SIGNALS)
    poll(lambda: gate.now_running() == {"a"}, what="child running")
    for _ in range(3000):
        proc.signal(signal.SIGTSTP)
    gate.release("a")
    assert proc.wait() == 0, proc.log()
    assert proc.log().count("event=suspend-refused") == 1, proc.log()


def test_sigterm_to_conch_terminates_child_releases_and_exits_with_its_status(
    conch: Runner, client: Client, name: str, tmp_path: Path
) -> None:
    marker = tmp_path / "trapped"
    script = (
        f"trap 'echo got-term > {marker}; exit 42' TERM; touch {tmp_path}/up; "
        "while :; do sleep 0.05; done"
    )
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script)
    poll(lambda: (tmp_path / "up").exists(), what="child up")
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 42
    assert marker.read_text().strip() == "got-term"
    assert sema_keys(client, name) == []
    events = proc.events()
    assert events.index("term-sent") < events.index("child-exit") < events.index("released")
    assert " code=42 " in proc.log()


def test_sigterm_while_queued_withdraws_and_exits_128_plus_signal(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    waiter = conch.start("sema", name, "--max", "1", "--", "true")
    poll(lambda: len(sema_keys(client, name)) == 2, what="waiter queued")
    waiter.signal(signal.SIGTERM)
    assert waiter.wait() == 128 + signal.SIGTERM
    assert len(sema_keys(client, name)) == 1
    gate.release("h")
    assert holder.wait() == 0


def _watchdogs_with(tag: str) -> list[int]:
    """Pids of running watchdogs whose environment has WATCHDOG_TAG=``tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            words = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            tagged = f"WATCHDOG_TAG={tag}".encode() in environ
            if tagged and any(w.endswith(b"_watchdog_main.py") for w in words):
                found.append(int(entry.name))
    return found


def test_a_failed_connection_leaves_no_watchdog(conch: Runner, name: str) -> None:
    """The command starts its watchdog before its imports; when the connection fails (69), a
    TLS file is missing or a flag is wrong (64), the watchdog is gone by the time it exits."""
    endpoint = f"127.0.0.1:{free_port()}"
    cases = (((), 69), (("--cacert", "/nonexistent"), 64), (("--ttl", "x"), 64))
    for extra, expected in cases:
        code, _, err = conch.run(
            "sema", name, "--max", "1", "--dial-timeout", "1s", "--endpoints", endpoint,
            *extra, "--", "true", WATCHDOG_TAG=name,
        )  # fmt: skip
        assert code == expected, err
        assert not _watchdogs_with(name)


def test_unreachable_endpoint_exits_69_within_the_dial_timeout(conch: Runner, name: str) -> None:
    began = time.monotonic()
    code, _, err = conch.run(
        "sema",
        name,
        "--max",
        "1",
        "--dial-timeout",
        "1s",
        "--endpoints",
        f"127.0.0.1:{free_port()}",
        "--",
        "true",
    )
    assert code == 69
    assert time.monotonic() - began < 10
    assert "Traceback" not in err and "cannot reach etcd" in err


def test_spread_allows_one_slot_per_host(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    a = conch.start(
        "sema", name, "--max", "2", "--spread", "--", *gate.cmd("a"), CONCH_HOST="hostA"
    )
    poll(lambda: gate.now_running() == {"a"}, what="hostA holds")
    code, _, _ = conch.run(
        "sema", name, "--max", "2", "--spread", "--nonblock", "--", "true", CONCH_HOST="hostA"
    )
    assert code == 75  # a host that already holds fails as if no slot were free
    b = conch.start(
        "sema", name, "--max", "2", "--spread", "--", *gate.cmd("b"), CONCH_HOST="hostB"
    )
    poll(lambda: gate.now_running() == {"a", "b"}, what="hostB holds too")
    assert sorted(k.key.rsplit(b"/", 1)[1] for k in sema_keys(client, name)) == [b"hostA", b"hostB"]
    gate.release("a")
    gate.release("b")
    assert a.wait() == 0 and b.wait() == 0


def test_spread_waiter_on_a_busy_host_gets_the_slot_when_it_frees(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    a = conch.start("sema", name, "--max", "2", "--spread", "--", *gate.cmd("a"), CONCH_HOST="h")
    poll(lambda: gate.now_running() == {"a"}, what="first on host h")
    a2 = conch.start("sema", name, "--max", "2", "--spread", "--", *gate.cmd("a2"), CONCH_HOST="h")
    poll(lambda: "event=spread-busy" in a2.log(), what="second on h to wait")
    assert gate.now_running() == {"a"}
    gate.release("a")
    poll(lambda: gate.now_running() == {"a2"}, what="second on h to take over")
    gate.release("a2")
    assert a.wait() == 0 and a2.wait() == 0


def test_who_prints_text_and_json_in_revision_order(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    procs = start_queue(conch, gate, name, 1, ["h", "w"], client)
    code, out, _ = conch.run("sema", name, "--who")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{name}[1/1] HELD  ")
    assert lines[1].startswith(f"{name}[1/1] WAIT  ")
    assert f"pid={procs[0].pid} " in lines[0] and "since=" in lines[0] and " rev=" in lines[0]
    records = who_json(conch, name, "--max", "1")
    assert [r["state"] for r in records] == ["HELD", "WAIT"]
    assert set(records[0]) >= {
        "name",
        "max",
        "state",
        "host",
        "pid",
        "started",
        "rev",
        "lease",
        "cmd",
    }
    assert records[0]["rev"] < records[1]["rev"]  # type: ignore[operator]
    assert records[0]["pid"] == procs[0].pid
    gate.release("h")
    gate.release("w")
    assert all(p.wait() == 0 for p in procs)
    code, out, _ = conch.run("sema", name, "--who")
    assert (code, out) == (1, "")


def test_who_shows_every_capacity_and_flags_the_others(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    one = conch.start("sema", name, "--max", "1", "--", *gate.cmd("one"))
    two = conch.start("sema", name, "--max", "2", "--", *gate.cmd("two"))
    poll(lambda: gate.now_running() == {"one", "two"}, what="both capacities held")
    code, out, err = conch.run("sema", name, "--max", "2", "--who")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == [f"{name}[1/2]", f"{name}[1/1]"]
    assert "event=other-capacity" in err and "max=1" in err
    gate.release("one")
    gate.release("two")
    assert one.wait() == 0 and two.wait() == 0


def test_who_against_an_unreachable_etcd_exits_69(conch: Runner, name: str) -> None:
    code, _, _ = conch.run(
        "sema", name, "--who", "--dial-timeout", "500ms", "--endpoints", f"127.0.0.1:{free_port()}"
    )
    assert code == 69


@pytest.mark.parametrize(
    "args",
    [
        ["sema", "", "--max", "1", "--", "true"],
        ["sema", "..", "--max", "1", "--", "true"],
        ["sema", "a\tb", "--max", "1", "--", "true"],
        ["sema", "x" * 201, "--max", "1", "--", "true"],
        ["sema", "n", "--max", "0", "--", "true"],
        ["sema", "n", "--max", "two", "--", "true"],
        ["sema", "n", "--max", "-1", "--", "true"],
        ["sema", "n", "--", "true"],
        ["sema", "n", "--max", "1"],
        ["sema", "n", "--max", "1", "--"],
        ["sema", "n", "--max", "1", "--ttl", "1.5s", "--", "true"],
        ["sema", "n", "--max", "1", "--wait", "soon", "--", "true"],
        ["sema", "n", "--max", "1", "--kill-after", "5x", "--", "true"],
        ["sema", "n", "--max", "1", "--dial-timeout", "-1s", "--", "true"],
        ["sema", "n", "--max", "1", "--wait", "1s", "--nonblock", "--", "true"],
        ["sema", "n", "--max", "1", "--bogus", "--", "true"],
        ["sema", "n", "--who", "--", "true"],
        ["sema", "n", "--who", "--ttl", "5s"],
        ["sema", "n", "--who", "--ttl", "soon"],
        ["sema", "n", "--who", "--nonblock"],
        ["sema", "n", "--who", "--kill-after", "1s"],
        ["sema", "n", "--max", "1", "--password", "pw", "--", "true"],
        ["sema", "--who", "--max", "1"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_input_exits_64_with_one_line_and_writes_nothing(
    conch: Runner, client: Client, args: list[str]
) -> None:
    code, _, err = conch.run(*args)
    assert code == 64, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("conch: ") and "Traceback" not in err
    assert sema_keys(client, "n") == []


def test_bad_env_duration_names_the_variable(conch: Runner, name: str) -> None:
    code, _, err = conch.run("sema", name, "--max", "1", "--", "true", CONCH_TTL="soon")
    assert code == 64
    assert "CONCH_TTL" in err
    code, _, err = conch.run("sema", name, "--who", CONCH_KILL_AFTER="5x")
    assert code == 64
    assert "CONCH_KILL_AFTER" in err


@pytest.mark.parametrize("odd", ["-x", "-1", "-xq"])
def test_a_name_that_starts_with_a_dash_right_after_sema(
    conch: Runner, client: Client, odd: str
) -> None:
    show = ["sh", "-c", 'printf "%s\\n" "$CONCH_NAME"']
    code, out, err = conch.run("sema", odd, "--max", "1", "--", *show)
    assert (code, out) == (0, f"{odd}\n"), err
    assert sema_keys(client, odd) == []
    # options after it are still options
    code, out, err = conch.run("sema", odd, "-q", "--max", "1", "--", *show)
    assert (code, out, err) == (0, f"{odd}\n", "")


def test_a_forgotten_name_before_a_short_option_stays_an_error(conch: Runner) -> None:
    for option in ("-n", "-q", "-nq"):
        code, _, err = conch.run("sema", option, "--max", "1", "--", "true")
        assert code == 64 and "NAME" in err, err


def test_flag_beats_env(conch: Runner, name: str) -> None:
    code, _, err = conch.run(
        "sema", name, "--max", "1", "--ttl", "4s", "--", "true", CONCH_TTL="7s"
    )
    assert code == 0
    assert "ttl=4s" in err


def test_quiet_keeps_only_warnings_and_errors(conch: Runner, name: str) -> None:
    code, _, err = conch.run("sema", name, "--max", "1", "--quiet", "--", "true")
    assert code == 0
    assert err == ""
    # etcd raises a TTL below its minimum (2 s here): a warning says so
    code, _, err = conch.run("sema", name, "--max", "1", "--quiet", "--ttl", "1", "--", "true")
    assert code == 0
    assert err == "conch: level=warning event=ttl-raised asked=1s granted=2s by=etcd\n"


def test_holder_json_is_stored_at_the_key(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    proc = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"), CONCH_HOST="node7")
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    (stored,) = sema_keys(client, name, 1)
    data = json.loads(stored.value)
    assert data["host"] == "node7" and data["pid"] == proc.pid
    assert data["cmd"] == "sh"  # the program's name; its arguments only with --record-args
    assert stored.key.endswith(f"/{stored.lease:x}".encode())
    gate.release("h")
    assert proc.wait() == 0


def test_a_waiter_promoted_on_its_first_look_still_wakes_the_one_behind(
    own_etcd: EtcdCluster, name: str
) -> None:
    """N=2: A and B hold; three other keys queue, then C (behind the last of them, watching
    it) and D (behind C, watching C). The three go and A leaves unseen by C but for the last
    deletion, so C holds on the look that deletion wakes it to; then B leaves: D must take
    B's slot (C's touch, owed at that look, is what woke D into the window)."""
    with own_etcd.client() as client:
        _first_look_promotion(own_etcd, client, name)


def _first_look_promotion(etcd: EtcdCluster, client: Client, name: str) -> None:
    from conch.hold import Hold
    from conch.semaphore import Semaphore

    a = Semaphore(client, name, 2, ttl=5).acquire(timeout=10)
    b = Semaphore(client, name, 2, ttl=5).acquire(timeout=10)
    holds: dict[str, Hold] = {}

    def acquire(who: str) -> None:
        holds[who] = Semaphore(client, name, 2, ttl=5).acquire(30)

    threads = {who: threading.Thread(target=acquire, args=(who,)) for who in "cd"}
    try:
        with other_keys(client, name, 2, 3) as others:
            threads["c"].start()
            poll(lambda: len(sema_keys(client, name)) == 6, what="C queued")
            threads["d"].start()
            poll(lambda: len(sema_keys(client, name)) == 7, what="D queued")
            poll(lambda: etcd_watchers(etcd) == 4, what="C watching the last key, D watching C")
            for key in others[:2]:
                kv.delete(client, key)
            a.release()
            kv.delete(client, others[2])  # C wakes and reads: B, C, D
            threads["c"].join(30)
        assert "c" in holds
        b.release()
        threads["d"].join(15)
        assert "d" in holds, "D slept while B's slot was free"
    finally:
        for thread in threads.values():
            if thread.ident is not None:
                thread.join(30)
        for hold in holds.values():
            hold.release()


def test_absurd_values_are_usage_errors(conch: Runner, name: str) -> None:
    for args in (
        ["--max", "1", "--kill-after", "3000000h"],
        ["--max", "1", "--wait", "3000000h"],
        ["--max", "100000000000000000000"],
        ["--max", "1", "--ttl", "99999999999999999999"],
        ["--max", "1", "--dial-timeout", "10000000h"],
        ["--max", "1", "--endpoints", "http://[::1"],
    ):
        code, _, err = conch.run("sema", name, *args, "--", "true")
        assert code == 64, (args, err)
        assert "Traceback" not in err


def test_a_zero_dial_timeout_or_a_control_character_in_conch_host_is_a_usage_error(
    conch: Runner, client: Client, name: str
) -> None:
    """A dial timeout of 0 would fail every connection at once ("within 0s"); a newline in
    CONCH_HOST would go into every key's value and, with --spread, into the key itself."""
    for args, env, named in (
        (["--dial-timeout", "0"], {}, "--dial-timeout"),
        ([], {"CONCH_DIAL_TIMEOUT": "0s"}, "CONCH_DIAL_TIMEOUT"),
        (["--spread"], {"CONCH_HOST": "node\nX"}, "CONCH_HOST"),
        ([], {"CONCH_HOST": "tab\there"}, "CONCH_HOST"),
    ):
        code, _, err = conch.run("sema", name, "--max", "1", *args, "--", "true", **env)  # type: ignore[arg-type]
        assert code == 64, (args, env, err)
        assert err.startswith(f"conch: bad {named} ") and len(err.splitlines()) == 1, err
    assert sema_keys(client, name) == []


def test_who_survives_hostile_values_and_cannot_be_forged(
    conch: Runner, client: Client, name: str
) -> None:
    from conch.etcd import kv

    base = f"/conch/v1/sema/{name}/1/".encode()
    kv.put(client, base + b"deep", b"[" * 100000)
    kv.put(client, base + b"forge", b'{"host":"evil\\nX[1/1] HELD  fake pid=1","pid":1}')
    code, out, err = conch.run("sema", name, "--who")
    assert code == 0 and "Traceback" not in err
    assert len(out.splitlines()) == 2
    code, _, _ = conch.run("sema", name, "--max", "2", "--who")
    assert code == 1  # nothing held at capacity 2


def test_child_inherits_stdin_stdout_and_stderr_only(etcd: EtcdCluster, name: str) -> None:
    """A descriptor conch itself inherited (here: fd w) does not reach the child."""
    r, w = os.pipe()
    os.set_inheritable(w, True)
    probe = f"if [ -e /proc/self/fd/{w} ]; then echo leaked; else echo clean; fi"
    conch = [sys.executable, "-m", "conch", "sema", name, "--max", "1"]
    try:
        result = subprocess.run(
            [*conch, "--endpoints", etcd.endpoints, "--", "sh", "-c", probe],
            pass_fds=(w,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(r)
        os.close(w)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"
