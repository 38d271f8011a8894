"""The asyncio face's I/O on its loop, against a real etcd: keepalives answered and watch
events delivered with no thread of conch's doing the work (only the loop's and gRPC's own),
the loop's streams failing over to another member, the auth token renewed on the loop, and
a process forked while a coroutine client was open still able to use conch.aio."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import conch.aio
from conch.etcd import aio as etcd_aio
from conch.etcd import kv
from conch.etcd.watch import WatchNotice
from tests.conftest import DEADLINE
from tests.etcd_server import EtcdCluster
from tests.faults.test_auth import auth_churn, jwt_etcd  # noqa: F401 (a fixture)
from tests.faults.test_security import PASSWORD
from tests.library.test_fork import FORK_SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def conch_threads() -> set[int | None]:
    """The threads of conch's own (its timers, keepalives and stream readers) alive now."""
    return {t.ident for t in threading.enumerate() if t.name.startswith("conch-")}


async def queued(client: conch.aio.Client, name: str, count: int) -> None:
    """Until ``count`` keys wait in semaphore ``name`` (max 1)."""
    prefix = f"/conch/v1/sema/{name}/1/".encode()
    request = kv.prefix_request(prefix, count_only=True)
    deadline = time.monotonic() + DEADLINE
    while (await etcd_aio.range_(client.sync, request)).count < count:
        assert time.monotonic() < deadline, f"fewer than {count} keys queued"
        await asyncio.sleep(0.02)  # the poll's interval, within its deadline


def test_keepalives_and_watch_events_of_coroutines_need_no_thread_of_conch(
    etcd: EtcdCluster, name: str
) -> None:
    """A holder kept alive past a TTL of keepalives and a waiter woken by its watch, with no
    conch thread started: the keepalive stream's answers and the watch's events are read
    by the loop (grpc.aio), not handed over by threads of ours."""

    async def main() -> None:
        async with conch.aio.connect(etcd.endpoints) as client:
            ttl = 3
            sema = conch.aio.Semaphore(client, name, max=1, ttl=ttl)
            holder = await sema.acquire(timeout=DEADLINE)

            async def wait() -> conch.aio.Hold:
                return await sema.acquire(timeout=DEADLINE)

            waiter = asyncio.create_task(wait())
            await queued(client, name, 2)
            # An observation window of one TTL and a margin: a hold none of whose
            # keepalives (one a TTL/3) is answered is lost within a TTL of the last answer.
            await asyncio.sleep(ttl + 1)
            assert not holder.lost.is_set()
            assert await etcd_aio.time_to_live(client.sync, holder.lease_id) > 0
            await holder.release()
            second = await asyncio.wait_for(waiter, DEADLINE)
            await second.release()

    before = conch_threads()
    asyncio.run(main())
    assert conch_threads() - before == set()


def test_the_loops_streams_fail_over_to_another_member(cluster: EtcdCluster, name: str) -> None:
    """The member the client talks to is killed: the holder's keepalives go on on another
    member (the hold outlives a TTL after the kill) and the waiter's watch moves too (it
    gets the slot when the holder releases)."""

    async def main() -> None:
        async with conch.aio.connect(cluster.endpoints, request_timeout=10) as client:
            ttl = 6
            sema = conch.aio.Semaphore(client, name, max=1, ttl=ttl)
            holder = await sema.acquire(timeout=DEADLINE)

            async def wait() -> conch.aio.Hold:
                return await sema.acquire(timeout=3 * DEADLINE)

            waiter = asyncio.create_task(wait())
            await queued(client, name, 2)
            used = str(client.sync.endpoint)
            member = next(m for m in cluster.members if m.endpoint.endswith(used))
            member.kill()
            # An observation window of one TTL and a margin: a hold whose keepalives did
            # not move is lost within a TTL of the last answer (its own count, whatever
            # etcd's election does to the lease).
            await asyncio.sleep(ttl + 1)
            assert not holder.lost.is_set(), holder
            assert str(client.sync.endpoint) != used
            await holder.release()
            second = await asyncio.wait_for(waiter, DEADLINE)
            await second.release()

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_loops_watch_renews_a_stale_token_under_auth_churn(
    jwt_etcd: EtcdCluster,  # noqa: F811
) -> None:
    """Every auth change makes the stream's JWT token stale, and etcd refuses a watch
    created with it: the loop's stream resumes with a fresh token, authenticated on the
    loop, and every watch gets its event."""
    key = b"/conch/v1/sema/churn/k"

    async def main(bumps: list[int]) -> tuple[int, int]:
        alice = conch.Credentials("alice", PASSWORD)
        async with conch.aio.connect(
            jwt_etcd.endpoints, request_timeout=20, credentials=alice
        ) as client:
            seen = i = 0
            while bumps[0] < 10:  # watches opened across ten auth changes, and more
                i += 1
                events: asyncio.Queue[WatchNotice] = asyncio.Queue()
                # From a revision, as conch's watches are: one refused and resumed
                # meanwhile still covers the put.
                now = await etcd_aio.range_(client.sync, kv.prefix_request(key))
                start = now.header.revision + 1
                watch = await etcd_aio.LoopWatch.open(client.sync, events.put_nowait, key, start)
                value = str(i).encode()
                await etcd_aio.txn(client.sync, [], [kv.op_put(key, value)], [])
                while True:
                    notice = await asyncio.wait_for(events.get(), 3 * DEADLINE)
                    assert notice.error is None, notice.error
                    if any(e.kv.value == value for e in notice.events):
                        seen += 1
                        break
                watch.cancel()
            return seen, i

    before = conch_threads()
    # Gentler than call_async's churn: a watch refused MAX_RESUMES times in a row ends
    # with the error, in either face, and a bump every 5 ms got there now and then.
    with auth_churn(jwt_etcd, pause=0.1) as bumps:
        seen, opened = asyncio.run(main(bumps))
    assert seen == opened and bumps[0] >= 10
    assert conch_threads() - before == set()


_FORKED = textwrap.dedent(
    """
    import asyncio, os, sys
    import conch.aio

    endpoints, name = sys.argv[1], sys.argv[2]

    async def cycle():
        async with conch.aio.connect(endpoints) as client:
            sema = conch.aio.Semaphore(client, name, max=1, ttl=5)
            async with sema.acquire(timeout=10) as hold:
                return hold.revision

    loop = asyncio.new_event_loop()  # the parent's, not running at the fork
    client = loop.run_until_complete(conch.aio.connect(endpoints))  # open across it
    loop.run_until_complete(conch.aio.who(client, name))
    pid = os.fork()
    if pid == 0:
        revision = asyncio.run(asyncio.wait_for(cycle(), 20))
        print("child", revision, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    loop.run_until_complete(client.close())
    print("parent", status, flush=True)
    """
)


def test_a_child_forked_while_a_coroutine_client_is_open_uses_conch_aio(
    etcd: EtcdCluster, name: str, tmp_path: Path
) -> None:
    """gRPC's asyncio stack does not survive a fork while one of its channels is open (a
    child's calls then hang past every deadline): such a child's coroutines acquire all
    the same, on the blocking stack."""
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **FORK_SETTINGS)
    out = subprocess.run(
        [sys.executable, str(script), etcd.endpoints, name],
        env=environ,
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE,
    )
    lines = out.stdout.split()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "child" in lines and lines[-2:] == ["parent", "0"], out.stdout
