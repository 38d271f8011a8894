"""Pre-fork servers: a process that used conch and then forks gives children that connect and
acquire with their own Client; the parent's Client in a child raises at once.

Each case runs in a fresh interpreter, so that gRPC's fork settings and import order are the
case's own and not those of the pytest process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conch.etcd import Client
from tests.conftest import DEADLINE, sema_keys
from tests.etcd_server import EtcdCluster

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
# What docs/embedding.md tells a pre-fork server to set (gRPC's doc/fork_support.md): gRPC
# Python's own fork handlers, on the poll poller. Without them, 1 run in about 25 of the
# os.fork case hung in a child's first grpc.insecure_channel() on a loaded machine.
FORK_SETTINGS = {"GRPC_ENABLE_FORK_SUPPORT": "true", "GRPC_POLL_STRATEGY": "poll"}

# The parent connects, holds a slot and releases it, and closes its Client (what gRPC needs
# for fork without exec: no call or stream in flight at fork time, see docs/embedding.md),
# then forks WORKERS children: the gunicorn --preload case. Each child first tries the
# parent's Client (it must raise UsageError at once, a coroutine's call with no loop running
# too), then connects its own and acquires a slot. Prints one line per child: "child I
# parent-client=<seconds to raise> rev=<revision>", then "parent <children's exit codes>
# <keys left>".
HANG_AFTER = 15  # seconds: a child past it has hung
_PREFORK = f"HANG_AFTER = {HANG_AFTER}\n" + textwrap.dedent(
    """
    import os, sys, time
    if sys.argv[3] == "grpc-first":
        import grpc  # noqa: F401
    import multiprocessing
    import conch

    endpoints, name, how, errdir = sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]

    def work(parent_client, i):
        # A child stuck past HANG_AFTER writes where (its own file) and exits 1: the test
        # tells a hang in gRPC's own channel creation from one of conch's.
        import faulthandler
        err = os.open(os.path.join(errdir, f"child{i}.err"), os.O_WRONLY | os.O_CREAT, 0o600)
        faulthandler.dump_traceback_later(HANG_AFTER, exit=True, file=err)
        started = time.monotonic()
        try:
            conch.who(parent_client, name)
            raise SystemExit(f"child {i}: the parent's client answered")
        except conch.UsageError:
            raised = time.monotonic() - started
        try:  # the coroutines' call, with no loop running: still the fork's UsageError
            parent_client.call_async("maintenance", "Status", None).send(None)
            raise SystemExit(f"child {i}: the parent's client answered a coroutine")
        except conch.UsageError:
            pass
        with conch.connect(endpoints) as client:
            sema = conch.Semaphore(client, name, max=16, ttl=5)
            with sema.acquire(timeout=10) as hold:
                line = f"child {i} parent-client={raised:.3f} rev={hold.revision}\\n"
                os.write(1, line.encode())  # one write: the children share the pipe

    def forked(parent_client, i):
        code = 1
        try:
            work(parent_client, i)
            code = 0
        except BaseException as exc:
            print(f"child {i} failed: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)

    client = conch.connect(endpoints)
    with client, conch.Semaphore(client, name, max=16, ttl=5).acquire(timeout=10):
        pass
    if how == "multiprocessing":
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=work, args=(client, i)) for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
    else:  # gunicorn-style: plain os.fork() of workers from the master
        pids = []
        for i in range(4):
            pid = os.fork()
            if pid == 0:
                forked(client, i)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    with conch.connect(endpoints, dial_timeout=10) as again:  # the parent goes on using conch
        print("parent", codes, len(conch.who(again, name)), flush=True)
    """
)


def _run_prefork(
    etcd: EtcdCluster, tmp_path: Path, name: str, order: str, how: str, **env: str
) -> tuple[int | None, str, str]:
    """(exit code or None if it ran past 2 DEADLINE, stdout, stderr) of _PREFORK. Output goes
    to files: a hung child would keep a pipe open after its parent is gone."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **FORK_SETTINGS)
    environ.update(env)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PREFORK, etcd.endpoints, name, order, how, str(tmp_path)],
            env=environ,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        code: int | None = proc.wait(timeout=2 * DEADLINE)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the children too, should any be left
    proc.wait()
    return code, out.read_text(), err.read_text()


@pytest.mark.parametrize("how", ["multiprocessing", "os.fork"])
@pytest.mark.parametrize("order", ["conch-first", "grpc-first"])
def test_forked_workers_of_a_parent_that_used_conch_connect_and_acquire(
    etcd: EtcdCluster, client: Client, tmp_path: Path, name: str, order: str, how: str
) -> None:
    """Before the fix, importing conch set GRPC_ENABLE_FORK_SUPPORT=false and every child
    hung in gRPC on its first call (the run times out); with grpc imported first it did not.

    gRPC itself (grpcio 1.85, fork support on) now and then hangs a forked child in its
    channel creation, holding the GIL, on a loaded machine (about 1 child in 30 here): no
    client library can bound that. Such a child is told apart by where it hung; every other
    child must connect and acquire, and at least one always does."""
    code, stdout, stderr = _run_prefork(etcd, tmp_path, name, order, how)
    assert code == 0, stderr
    lines = stdout.splitlines()
    children = {int(line.split()[1]): line for line in lines if line.startswith("child ")}
    for i in set(range(WORKERS)) - set(children):
        where = (tmp_path / f"child{i}.err").read_text()
        innermost = where.split("(most recent call first):")[1].strip().splitlines()[0]
        assert "grpc/_channel.py" in innermost and "__init__" in innermost, where
    assert children, stdout
    # The parent's client raised at once in every child, never waited on gRPC.
    assert all(float(line.split()[2].split("=")[1]) < 1.0 for line in children.values())
    revisions = {line.split()[3] for line in children.values()}
    assert len(revisions) == len(children)  # each child held a slot of its own
    codes = [0 if i in children else 1 for i in range(WORKERS)]
    assert lines[-1] == f"parent {codes} 0"
    assert sema_keys(client, name) == []


def test_fork_support_turned_off_makes_a_forked_child_fail_fast(
    etcd: EtcdCluster, client: Client, tmp_path: Path, name: str
) -> None:
    """With GRPC_ENABLE_FORK_SUPPORT=false in the parent, a forked child's calls would hang
    in gRPC for good: its connect() says so at once instead."""
    code, stdout, stderr = _run_prefork(
        etcd, tmp_path, name, "conch-first", "os.fork", GRPC_ENABLE_FORK_SUPPORT="false"
    )
    assert code == 0, stderr
    assert stdout.splitlines()[-1] == f"parent {[1] * WORKERS} 0"
    assert "GRPC_ENABLE_FORK_SUPPORT=false: a forked process cannot use gRPC" in stderr
    assert sema_keys(client, name) == []


def test_the_library_leaves_the_environment_alone(etcd: EtcdCluster, name: str) -> None:
    """Importing conch and holding a slot changes no environment variable (it used to set
    GRPC_ENABLE_FORK_SUPPORT, which every forked worker and subprocess inherited)."""
    script = textwrap.dedent(
        """
        import os, sys
        before = dict(os.environ)
        import conch, conch.etcd, conch.semaphore, conch.supervisor
        with conch.connect(sys.argv[1]) as client:
            with conch.Semaphore(client, sys.argv[2], max=1).acquire(timeout=10):
                pass
        print(sorted(set(os.environ.items()) ^ set(before.items())))
        """
    )
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    environ["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script, etcd.endpoints, name],
        env=environ,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# A service forks from a coroutine while conch.aio holds a slot of NAME and another task
# waits for one: the child uses conch.aio afresh (asyncio.run of its own: a slot of NAME-child),
# then returns through the parent's coroutine, so the parent's hold, client and tasks unwind
# and asyncio.run tears down in the child. The child prints "child rev=R" and, once its
# asyncio.run is over, "child over"; the parent "parent kept rev=R child=<exit status>".
_IN_LOOP = f"HANG_AFTER = {HANG_AFTER}\n" + textwrap.dedent(
    """
    import asyncio, faulthandler, os, sys, time
    import conch, conch.aio

    endpoints, name, errdir, waits = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    forked = False

    async def child():
        async with conch.aio.connect(endpoints) as client:
            sema = conch.aio.Semaphore(client, name + "-child", max=1, ttl=5)
            async with sema.acquire(timeout=10) as hold:
                print(f"child rev={hold.revision}", flush=True)

    async def main():
        global forked
        async with conch.aio.connect(endpoints) as client:
            sema = conch.aio.Semaphore(client, name, max=1, ttl=5)
            async with sema.acquire(timeout=10) as hold:
                if waits == "waits":
                    waiting = asyncio.ensure_future(sema.acquire(timeout=60))
                    queued_by = time.monotonic() + HANG_AFTER
                    while len(await conch.aio.who(client, name)) < 2:
                        if time.monotonic() > queued_by:
                            sys.exit("the waiter never queued")
                        await asyncio.sleep(0.05)
                pid = os.fork()
                if pid == 0:
                    forked = True
                    err = os.open(os.path.join(errdir, "child.err"), os.O_WRONLY | os.O_CREAT)
                    faulthandler.dump_traceback_later(HANG_AFTER, exit=True, file=err)
                    asyncio.run(child())
                    return  # through the parent's hold, waiter and client
                deadline = time.monotonic() + 2 * HANG_AFTER
                while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                    if time.monotonic() > deadline:
                        os.kill(pid, 9)  # reaped by the next waitpid
                    await asyncio.sleep(0.1)
                await hold.check()  # raises HoldLost unless the slot is certainly ours
                print(f"parent kept rev={hold.revision} child={done[1]}", flush=True)
                if waits == "waits":
                    waiting.cancel()
                    await asyncio.gather(waiting, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        if forked:
            print("child over", flush=True)
    """
)


@pytest.mark.parametrize("waits", ["holds", "waits"])
def test_a_fork_from_a_coroutine_frees_the_child_and_the_parent_keeps_its_hold(
    etcd: EtcdCluster, client: Client, tmp_path: Path, name: str, waits: str
) -> None:
    """Forked from a running loop while grpc.aio channels are open (a hold's keepalive
    stream and watch, a waiter's watch), the child connects and acquires afresh, and then
    ends: its unwinding of the parent's hold and client and its asyncio.run's teardown do not
    hang. Before, dropping the parent's grpc.aio channel in the child ran gRPC's destructor
    there, which hung the child (and, writing into the connection it shares with the
    parent, could cost the parent its keepalives and so its hold)."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **FORK_SETTINGS)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _IN_LOOP, etcd.endpoints, name, str(tmp_path), waits],
            env=environ,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        code: int | None = proc.wait(timeout=3 * HANG_AFTER)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    lines = out.read_text().splitlines()
    hung = tmp_path / "child.err"
    assert code == 0, (lines, err.read_text(), hung.exists() and hung.read_text())
    assert "child over" in lines, (lines, hung.exists() and hung.read_text())
    assert [line for line in lines if line.startswith("child rev=")], lines
    assert [line for line in lines if line.startswith("parent kept rev=")], lines
    assert sema_keys(client, name) == []
    assert sema_keys(client, name + "-child") == []
