"""The etcd layer for coroutines (Client.call_async, conch.etcd.aio) against a real etcd:
the same failover, deadlines and token renewal as the threaded calls, and no thread per
call or per waiting watch."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conchpb.etcdserverpb import rpc_pb2

from conch.errors import LeaseNotFound, Unavailable
from conch.etcd import Client, Endpoint, kv, lease
from conch.etcd import aio as etcd_aio
from conch.etcd.client import Credentials
from conch.etcd.watch import WatchNotice
from tests.conftest import DEADLINE, poll
from tests.delayproxy import FaultProxy
from tests.etcd.test_etcd_layer import ttl_of
from tests.etcd_server import EtcdCluster
from tests.faults.test_auth import auth_churn, jwt_etcd  # noqa: F401 (a fixture)
from tests.faults.test_security import PASSWORD


async def keepalive(client: Client, lease_id: int, deadline: float) -> int:
    """``etcd_aio.keepalive`` awaited: the TTL, or the EtcdError it ended with raised."""
    answer: asyncio.Future[lease.Outcome] = asyncio.get_running_loop().create_future()
    etcd_aio.keepalive(client, lease_id, deadline, answer.set_result)
    return ttl_of(await answer)


@pytest.fixture
def nowhere() -> Iterator[Endpoint]:
    """An endpoint nothing listens on (its port held, so nobody else takes it)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        yield Endpoint("127.0.0.1", unused.getsockname()[1], False)


def test_call_async_fails_over_from_a_dead_endpoint(etcd: EtcdCluster, nowhere: Endpoint) -> None:
    live = Endpoint.parse(etcd.endpoints.split(",")[0])

    async def main() -> rpc_pb2.RangeResponse:
        with Client([nowhere, live]) as client:
            response = await etcd_aio.range_(client, rpc_pb2.RangeRequest(key=b"/nothing"))
            assert client.endpoint == live
            return response

    assert asyncio.run(main()).header.revision > 0


def test_call_async_gives_up_at_its_deadline(nowhere: Endpoint) -> None:
    async def main() -> float:
        with Client([nowhere], request_timeout=30) as client:
            started = time.monotonic()
            with pytest.raises(Unavailable):
                await client.call_async("kv", "Range", rpc_pb2.RangeRequest(key=b"/x"), 0.5)
            return time.monotonic() - started

    assert 0.4 < asyncio.run(main()) < 3


def test_call_async_maps_etcd_errors(etcd: EtcdCluster, client: Client) -> None:
    async def main() -> None:
        with pytest.raises(LeaseNotFound):
            await client.call_async(
                "lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=0x7FFF_FFFF_0001)
            )

    asyncio.run(main())


def test_cancelling_call_async_cancels_the_attempt_at_once(nowhere: Endpoint) -> None:
    """A call into a black hole (nothing answers, the attempt would run 30 s) is cancelled by
    the task's cancel, and the loop is not left with it."""

    async def main() -> float:
        with Client([nowhere], request_timeout=30) as client:
            task = asyncio.ensure_future(etcd_aio.range_(client, rpc_pb2.RangeRequest(key=b"/x")))
            # Where the cancel lands (the scenario, not a synchronisation): 0.2 s into the
            # attempt, which would run 30 s; no state marks a point in it.
            await asyncio.sleep(0.2)
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return time.monotonic() - started

    assert asyncio.run(main()) < 1


def test_a_hundred_concurrent_calls_start_no_thread_each(etcd: EtcdCluster, client: Client) -> None:
    async def main() -> tuple[int, int]:
        await etcd_aio.range_(client, rpc_pb2.RangeRequest(key=b"/warm"))  # the channel's own
        before = threading.active_count()
        calls = [etcd_aio.range_(client, rpc_pb2.RangeRequest(key=b"/x")) for _ in range(100)]
        gathered = asyncio.gather(*calls)
        await asyncio.sleep(0)  # one turn of the loop: each call has started, none answered
        during = threading.active_count()
        await gathered
        return before, during

    before, during = asyncio.run(main())
    assert during - before <= 2, (before, during)


def test_a_loop_watch_delivers_on_the_loop_and_nothing_after_cancel(
    client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """The watching client goes through a proxy, which shows when etcd's notice of a put
    has been passed on: the loop, blocked until then, reads it only after the cancel, and
    must drop it. A second watch on the same stream, of a key put after, tells when the
    first notice would have been delivered (one stream delivers in revision order)."""
    key, later = f"/t/{name}".encode(), f"/t/{name}/later".encode()
    proxy = proxies()

    def passed_on(value: bytes) -> bool:
        return any(
            not s.sent
            and s.method == "Watch"
            and any(e.kv.value == value for e in s.message.events)
            for s in proxy.seen
        )

    async def main(own: Client) -> None:
        notices: asyncio.Queue[WatchNotice] = asyncio.Queue()
        afterwards: asyncio.Queue[WatchNotice] = asyncio.Queue()
        on_loop: list[bool] = []

        def on_notice(notice: WatchNotice) -> None:
            on_loop.append(threading.current_thread() is threading.main_thread())
            notices.put_nowait(notice)

        watch = await etcd_aio.LoopWatch.open(own, on_notice, key, confirm=True)
        created = await asyncio.wait_for(notices.get(), DEADLINE)
        assert created.created
        second = await etcd_aio.LoopWatch.open(own, afterwards.put_nowait, later, confirm=True)
        assert (await asyncio.wait_for(afterwards.get(), DEADLINE)).created
        kv.put(client, key, b"1")
        notice = await asyncio.wait_for(notices.get(), DEADLINE)
        assert [e.kv.value for e in notice.events] == [b"1"]
        kv.put(client, key, b"2")
        kv.put(client, later, b"3")
        # The loop is blocked on purpose (a poll that does not yield) until etcd's notices
        # of both puts are on their way to the client, which reads them after the cancel.
        poll(lambda: passed_on(b"2") and passed_on(b"3"), what="etcd's notices passed on")
        watch.cancel()
        notice = await asyncio.wait_for(afterwards.get(), DEADLINE)
        assert [e.kv.value for e in notice.events] == [b"3"]
        second.cancel()
        assert notices.empty()
        assert on_loop == [True, True]

    with proxy.client() as own:
        asyncio.run(main(own))


def test_keepalives_of_many_leases_share_one_stream(client: Client) -> None:
    async def main() -> list[int]:
        grants = [await etcd_aio.grant(client, 5) for _ in range(20)]
        deadline = time.monotonic() + DEADLINE
        await keepalive(client, grants[0].id, deadline)  # the stream, its threads
        before = threading.active_count()
        ttls = await asyncio.gather(*(keepalive(client, g.id, deadline) for g in grants))
        assert threading.active_count() <= before  # one stream, for all (others may end)
        for g in grants:
            await etcd_aio.revoke(client, g.id)
        with pytest.raises(LeaseNotFound):
            await keepalive(client, grants[0].id, time.monotonic() + DEADLINE)
        for g in grants:
            etcd_aio.forget_lease(client, g.id)
        return list(ttls)

    assert asyncio.run(main()) == [5] * 20


async def _poll_stopped(pid: int) -> None:
    """Until every thread of process ``pid`` is stopped (state T in /proc)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state == "T" for state in states):
            return
        assert time.monotonic() < deadline, f"etcd ({pid}) not stopped: {states}"
        await asyncio.sleep(0.01)  # the poll's interval, within its deadline


def test_a_keepalive_unanswered_by_its_deadline_raises_unavailable(etcd: EtcdCluster) -> None:
    """A member that stops answering (SIGSTOP) leaves the keepalive unanswered: Unavailable
    at the deadline, not a hang."""
    member = etcd.members[0] if len(etcd.members) == 1 else None
    if member is None:
        pytest.skip("needs the one-member test etcd")

    async def main() -> float:
        with etcd.client() as client:
            granted = await etcd_aio.grant(client, 10)
            await keepalive(client, granted.id, time.monotonic() + DEADLINE)
            member.pause()
            # SIGSTOP reaches each of etcd's threads on its own: one still running answered
            # a keepalive sent at once (1 run in 8).
            await _poll_stopped(member.process.pid if member.process else 0)
            try:
                started = time.monotonic()
                with pytest.raises(Unavailable):
                    await keepalive(client, granted.id, started + 1.0)
                return time.monotonic() - started
            finally:
                member.resume()
                lease.revoke(client, granted.id)

    assert asyncio.run(main()) < 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_call_async_renews_a_stale_token_under_auth_churn(jwt_etcd: EtcdCluster) -> None:  # noqa: F811
    """Every auth change makes the JWT token stale: each call authenticates again (one
    Authenticate for the coroutines that meet it together) and gets through."""
    endpoints = [Endpoint.parse(e) for e in jwt_etcd.endpoints.split(",")]
    request = rpc_pb2.RangeRequest(key=b"/conch/v1/sema/x")

    async def main() -> tuple[int, int]:
        alice = Credentials("alice", PASSWORD)
        # Generous: under the churn and a loaded machine one call took over 5 s.
        with Client.connect(endpoints, request_timeout=20, credentials=alice) as client:
            rounds, done, start = 0, 0, bumps[0]
            # Ten rounds at least, and on until five auth changes came among them (under
            # load the churn may lag: the calls must meet it all the same).
            while rounds < 10 or bumps[0] - start < 5:
                answers = await asyncio.gather(
                    *(etcd_aio.range_(client, request) for _ in range(5))
                )
                rounds, done = rounds + 1, done + len(answers)
                await asyncio.sleep(0.05)  # the rounds' pace among the changes (the scenario)
            return rounds, done

    with auth_churn(jwt_etcd) as bumps:
        rounds, done = asyncio.run(main())
    assert done == 5 * rounds


_LOOPS_FREED = """
import asyncio, gc, sys, weakref
from conchpb.etcdserverpb import rpc_pb2
from conch.etcd import Client, Endpoint

loops = []

async def one_call(client):
    loops.append(weakref.ref(asyncio.get_running_loop()))
    await client.call_async("kv", "Range", rpc_pb2.RangeRequest(key=b"/loops/"), timeout=30)

with Client.connect([Endpoint.parse(sys.argv[1])]) as client:
    for _ in range(3):
        asyncio.run(one_call(client))
    gc.collect()
    print(sum(ref() is not None for ref in loops[:-1]))
"""


def test_an_event_loop_that_made_calls_is_freed_once_it_ends(etcd: EtcdCluster) -> None:
    """A service that runs ``asyncio.run`` again and again on one client (a fresh process,
    as gRPC's own completion queue may keep loops of calls that failed): an ended loop
    that made calls goes once dropped (the client closes its channels when the next loop
    makes a call). The calls' admission per loop kept the loop it is keyed by (a weak key
    whose value held it strongly), so none was ever freed."""
    run = [sys.executable, "-c", _LOOPS_FREED, etcd.members[0].endpoint]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["0"], done
