"""One suite, both faces: every scenario here runs through the threaded API (``conch``) and
the asyncio one (``conch.aio``), against a real etcd, so that the two cannot drift apart.

A scenario is a coroutine written once against a small adapter (``Face``). The asyncio
face's adapter awaits ``conch.aio`` directly; the threaded face's runs each blocking call
of ``conch`` on a thread (``asyncio.to_thread``) and the ones that do not block (``check``,
``expires_at``) directly. Each scenario runs under ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import sys
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import pytest
from conchpb.etcdserverpb import rpc_pb2

import conch
import conch.aio
from conch import keys
from conch.etcd import Client, kv, lease
from tests.conftest import DEADLINE, etcd_watchers, sema_keys
from tests.delayproxy import DelayProxy
from tests.etcd_server import EtcdCluster
from tests.faults.test_auth import alice, authenticate_calls, enable_auth
from tests.faults.test_security import PASSWORD


class Face(Protocol):
    """What a scenario may do, the same through either face. Handles (clients, semaphores,
    holds, sessions) are the face's own objects."""

    name: str
    interrupted: type[BaseException]  # what an interrupted wait raises
    endpoints: str  # what ``connect`` connects to

    def at(
        self,
        etcd: EtcdCluster,
        request_timeout: float = 5.0,
        credentials: conch.Credentials | None = None,
    ) -> Face: ...
    def connect(self) -> contextlib.AbstractAsyncContextManager[Any]: ...
    def semaphore(self, client: Any, name: str, max: int, ttl: int = 5) -> Any: ...
    def session(self, client: Any, ttl: int = 5) -> contextlib.AbstractAsyncContextManager[Any]: ...
    async def acquire(
        self, sema: Any, timeout: float | None = None, session: Any = None
    ) -> Any: ...
    def holding(
        self, sema: Any, timeout: float | None = None, session: Any = None
    ) -> contextlib.AbstractAsyncContextManager[Any]: ...
    async def release(self, hold: Any) -> None: ...
    async def check(self, hold: Any) -> None: ...
    async def put(self, hold: Any, key: bytes, value: bytes) -> int: ...
    async def delete(self, hold: Any, key: bytes) -> int: ...
    async def who(self, client: Any, name: str) -> list[conch.Record]: ...
    async def wait_lost(self, hold: Any) -> None: ...
    def expires_at(self, hold: Any) -> float: ...
    async def interrupt_waiting(
        self, sema: Any, queued: Callable[[], bool], session: Any = None
    ) -> BaseException | None: ...


async def _poll(check: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Threaded:
    """The threaded face: blocking calls on a thread each, so the scenario's loop runs."""

    name = "threaded"
    interrupted: type[BaseException] = conch.Interrupted

    def __init__(
        self,
        etcd: EtcdCluster,
        request_timeout: float = 5.0,
        credentials: conch.Credentials | None = None,
    ) -> None:
        self.endpoints = etcd.endpoints
        self.request_timeout = request_timeout
        self.credentials = credentials

    def at(
        self,
        etcd: EtcdCluster,
        request_timeout: float = 5.0,
        credentials: conch.Credentials | None = None,
    ) -> Face:
        """This face on another etcd, its calls with ``request_timeout`` and
        ``credentials``."""
        return type(self)(etcd, request_timeout, credentials)

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[conch.Client]:
        connect = functools.partial(
            conch.connect, request_timeout=self.request_timeout, credentials=self.credentials
        )
        client = await asyncio.to_thread(connect, self.endpoints)
        try:
            yield client
        finally:
            await asyncio.to_thread(client.close)

    def semaphore(self, client: conch.Client, name: str, max: int, ttl: int = 5) -> Any:
        return conch.Semaphore(client, name, max=max, ttl=ttl)

    @contextlib.asynccontextmanager
    async def session(self, client: conch.Client, ttl: int = 5) -> AsyncIterator[conch.Session]:
        session = await asyncio.to_thread(conch.Session, client, ttl)
        try:
            yield session
        finally:
            await asyncio.to_thread(session.close)

    async def acquire(
        self, sema: conch.Semaphore, timeout: float | None = None, session: Any = None
    ) -> conch.Hold:
        return await asyncio.to_thread(sema.acquire, timeout, None, session)

    @contextlib.asynccontextmanager
    async def holding(
        self, sema: conch.Semaphore, timeout: float | None = None, session: Any = None
    ) -> AsyncIterator[conch.Hold]:
        hold = await self.acquire(sema, timeout, session)
        try:
            yield hold
        except BaseException:
            # ``with hold:`` leaving with the block's exception (it never suppresses one).
            await asyncio.to_thread(hold.__exit__, *sys.exc_info())
            raise
        else:
            await asyncio.to_thread(hold.__exit__, None, None, None)

    async def release(self, hold: conch.Hold) -> None:
        await asyncio.to_thread(hold.release)

    async def check(self, hold: conch.Hold) -> None:
        hold.check()

    async def put(self, hold: conch.Hold, key: bytes, value: bytes) -> int:
        return await asyncio.to_thread(hold.put, key, value)

    async def delete(self, hold: conch.Hold, key: bytes) -> int:
        return await asyncio.to_thread(hold.delete, key)

    async def who(self, client: conch.Client, name: str) -> list[conch.Record]:
        return await asyncio.to_thread(conch.who, client, name)

    async def wait_lost(self, hold: conch.Hold) -> None:
        deadline = time.monotonic() + DEADLINE
        # in short waits: a cancelled wait leaves no thread behind for asyncio.run to join
        while not await asyncio.to_thread(hold.lost.wait, 0.1):
            assert time.monotonic() < deadline, "the hold was not lost"

    def expires_at(self, hold: conch.Hold) -> float:
        result: float = hold.expires_at()
        return result

    async def interrupt_waiting(
        self, sema: conch.Semaphore, queued: Callable[[], bool], session: Any = None
    ) -> BaseException | None:
        interrupt = conch.Flag("interrupt")
        waiting = asyncio.ensure_future(asyncio.to_thread(sema.acquire, None, interrupt, session))
        await _poll(queued, "the waiter queued")
        interrupt.set("test")
        try:
            hold = await waiting
        except BaseException as exc:
            return exc
        await asyncio.to_thread(hold.release)
        return None


class Asyncio:
    """The asyncio face, awaited as it is."""

    name = "asyncio"
    interrupted: type[BaseException] = asyncio.CancelledError

    def __init__(
        self,
        etcd: EtcdCluster,
        request_timeout: float = 5.0,
        credentials: conch.Credentials | None = None,
    ) -> None:
        self.endpoints = etcd.endpoints
        self.request_timeout = request_timeout
        self.credentials = credentials

    def at(
        self,
        etcd: EtcdCluster,
        request_timeout: float = 5.0,
        credentials: conch.Credentials | None = None,
    ) -> Face:
        """This face on another etcd, its calls with ``request_timeout`` and
        ``credentials``."""
        return type(self)(etcd, request_timeout, credentials)

    def connect(self) -> contextlib.AbstractAsyncContextManager[conch.aio.Client]:
        return conch.aio.connect(
            self.endpoints, request_timeout=self.request_timeout, credentials=self.credentials
        )

    def semaphore(self, client: conch.aio.Client, name: str, max: int, ttl: int = 5) -> Any:
        return conch.aio.Semaphore(client, name, max=max, ttl=ttl)

    def session(
        self, client: conch.aio.Client, ttl: int = 5
    ) -> contextlib.AbstractAsyncContextManager[conch.aio.Session]:
        return conch.aio.Session(client, ttl)

    async def acquire(
        self, sema: conch.aio.Semaphore, timeout: float | None = None, session: Any = None
    ) -> conch.aio.Hold:
        hold: conch.aio.Hold = await self.holding(sema, timeout, session)  # type: ignore[misc]
        return hold

    def holding(
        self, sema: conch.aio.Semaphore, timeout: float | None = None, session: Any = None
    ) -> contextlib.AbstractAsyncContextManager[conch.aio.Hold]:
        if session is None:
            return sema.acquire(timeout)
        return sema.acquire(timeout, session=session)

    async def release(self, hold: conch.aio.Hold) -> None:
        await hold.release()

    async def check(self, hold: conch.aio.Hold) -> None:
        await hold.check()

    async def put(self, hold: conch.aio.Hold, key: bytes, value: bytes) -> int:
        return await hold.put(key, value)

    async def delete(self, hold: conch.aio.Hold, key: bytes) -> int:
        return await hold.delete(key)

    async def who(self, client: conch.aio.Client, name: str) -> list[conch.Record]:
        return await conch.aio.who(client, name)

    async def wait_lost(self, hold: conch.aio.Hold) -> None:
        await asyncio.wait_for(hold.lost.wait(), DEADLINE)

    def expires_at(self, hold: conch.aio.Hold) -> float:
        return hold.expires_at()

    async def interrupt_waiting(
        self, sema: conch.aio.Semaphore, queued: Callable[[], bool], session: Any = None
    ) -> BaseException | None:
        waiting = asyncio.ensure_future(self.acquire(sema, session=session))
        await _poll(queued, "the waiter queued")
        waiting.cancel()
        try:
            hold = await waiting
        except BaseException as exc:
            return exc
        await hold.release()
        return None


@pytest.fixture(params=[Threaded, Asyncio], ids=lambda face: face.name)
def face(request: pytest.FixtureRequest, etcd: EtcdCluster) -> Face:
    made: Face = request.param(etcd)
    return made


Scenario = Callable[[Any], Coroutine[Any, Any, None]]


def run(face: Face, scenario: Callable[[Any], Awaitable[None]]) -> None:
    """Run ``scenario(client)`` under asyncio.run with a client of ``face``."""

    async def main() -> None:
        async with face.connect() as client:
            await scenario(client)

    asyncio.run(main())


def revisions(client: Client, name: str) -> list[int]:
    return [k.create_revision for k in sema_keys(client, name)]


# -- the scenarios --------------------------------------------------------------------------


def test_acquire_holds_a_slot_at_our_key_s_revision_and_release_frees_it(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        sema = face.semaphore(fclient, name, max=2)
        hold = await face.acquire(sema, timeout=10)
        [key] = sema_keys(client, name)
        assert (hold.revision, hold.lease_id) == (key.create_revision, key.lease)
        await face.check(hold)
        await face.release(hold)
        assert sema_keys(client, name) == []
        await face.release(hold)  # a second release is a no-op

    run(face, scenario)


def test_timeout_raises_no_slot_and_leaves_no_waiter_key(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        sema = face.semaphore(fclient, name, max=1)
        async with face.holding(sema, timeout=10) as hold:
            started = time.monotonic()
            with pytest.raises(conch.NoSlot):
                await face.acquire(face.semaphore(fclient, name, max=1), timeout=0.5)
            assert time.monotonic() - started >= 0.5
            assert revisions(client, name) == [hold.revision]

    run(face, scenario)
    assert sema_keys(client, name) == []


def test_nonblock_raises_no_slot_at_once_and_leaves_no_key(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        async with face.holding(face.semaphore(fclient, name, max=1), timeout=10) as hold:
            started = time.monotonic()
            with pytest.raises(conch.NoSlot):
                await face.acquire(face.semaphore(fclient, name, max=1), timeout=0)
            assert time.monotonic() - started < 5
            assert revisions(client, name) == [hold.revision]

    run(face, scenario)


def test_a_bad_timeout_is_a_usage_error_before_any_etcd_call(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(conch.UsageError):
                await face.acquire(face.semaphore(fclient, name, max=1), timeout=bad)
        assert sema_keys(client, name) == []

    run(face, scenario)


def test_an_explicit_release_inside_the_block_ends_it_without_error(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        async with face.holding(face.semaphore(fclient, name, max=1), timeout=10) as hold:
            await face.release(hold)
            assert sema_keys(client, name) == []
            with pytest.raises(conch.HoldLost):
                await face.check(hold)  # released: no longer ours

    run(face, scenario)


def test_check_raises_hold_lost_after_an_outside_revoke(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1), timeout=10)
        lease.revoke(client, hold.lease_id)
        await face.wait_lost(hold)
        with pytest.raises(conch.HoldLost):
            await face.check(hold)
        await face.release(hold)

    run(face, scenario)
    assert sema_keys(client, name) == []


def test_a_hold_lost_in_the_block_raises_hold_lost_when_it_ends(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        with pytest.raises(conch.HoldLost):
            async with face.holding(face.semaphore(fclient, name, max=1), timeout=10) as hold:
                lease.revoke(client, hold.lease_id)
                await face.wait_lost(hold)

    run(face, scenario)
    assert sema_keys(client, name) == []


def test_a_lost_hold_lets_the_block_s_own_exception_through(
    face: Face, client: Client, name: str
) -> None:
    class Failed(Exception):
        pass

    async def scenario(fclient: Any) -> None:
        with pytest.raises(Failed):
            async with face.holding(face.semaphore(fclient, name, max=1), timeout=10) as hold:
                lease.revoke(client, hold.lease_id)
                await face.wait_lost(hold)
                raise Failed

    run(face, scenario)


def test_guarded_put_and_delete_land_only_while_the_hold_is_ours(
    face: Face, client: Client, name: str
) -> None:
    data = f"/parity/{name}".encode()

    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1), timeout=10)
        written = await face.put(hold, data, b"v1")
        item = kv.get(client, data)
        assert item is not None and (item.value, item.mod_revision) == (b"v1", written)
        assert item.lease == 0  # outlives the hold
        deleted = await face.delete(hold, data)
        assert kv.get(client, data) is None and deleted > written
        lease.revoke(client, hold.lease_id)
        with pytest.raises(conch.HoldLost):
            await face.put(hold, data, b"v2")
        assert kv.get(client, data) is None
        assert hold.lost.is_set()
        await face.release(hold)

    run(face, scenario)


def test_who_lists_holders_then_waiters_in_revision_order(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        sema = face.semaphore(fclient, name, max=1)
        async with face.holding(sema, timeout=10) as hold:
            waiting = asyncio.ensure_future(face.acquire(face.semaphore(fclient, name, max=1)))
            await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
            records = await face.who(fclient, name)
            assert [(r.state, r.held, r.max) for r in records] == [("HELD", 1, 1), ("WAIT", 1, 1)]
            assert records[0].rev == hold.revision < records[1].rev
        second = await asyncio.wait_for(waiting, DEADLINE)
        assert [r.state for r in await face.who(fclient, name)] == ["HELD"]
        await face.release(second)
        assert await face.who(fclient, name) == []

    run(face, scenario)


def test_holds_share_one_session_lease_and_release_only_their_own_key(
    face: Face, client: Client, name: str
) -> None:
    other = f"{name}-b"

    async def scenario(fclient: Any) -> None:
        async with face.session(fclient) as session:
            first = await face.acquire(face.semaphore(fclient, name, max=1), 10, session)
            second = await face.acquire(face.semaphore(fclient, other, max=2), 10, session)
            assert first.lease_id == second.lease_id == session.lease_id
            await face.release(first)
            assert sema_keys(client, name) == []
            assert [k.lease for k in sema_keys(client, other)] == [session.lease_id]
            await face.check(second)
        # Closing the session revokes its lease: the hold left on it goes too.
        assert sema_keys(client, other) == []

    run(face, scenario)


def test_waiters_of_one_semaphore_on_one_session_queue_as_keys_of_its_lease_in_order(
    face: Face, client: Client, name: str
) -> None:
    """Three acquires of one semaphore at max 2 on one session: three keys on its one lease;
    the third holds once the first releases, and each release deletes its own key only."""

    async def scenario(fclient: Any) -> None:
        async with face.session(fclient) as session:
            sema = face.semaphore(fclient, name, max=2)
            first = await face.acquire(sema, 10, session)
            second = await face.acquire(sema, 10, session)
            third = asyncio.ensure_future(face.acquire(sema, 30, session))
            await _poll(lambda: len(sema_keys(client, name)) == 3, "the third key queued")
            queued = sema_keys(client, name)
            assert {k.lease for k in queued} == {session.lease_id}
            assert len({k.key for k in queued}) == 3
            assert not third.done(), "a third hold at max 2"
            await face.release(first)
            last = await asyncio.wait_for(third, DEADLINE)
            assert first.revision < second.revision < last.revision
            await face.check(second)
            await face.release(second)
            assert [k.create_revision for k in sema_keys(client, name)] == [last.revision]
            await face.release(last)
            assert sema_keys(client, name) == []
        assert lease.time_to_live(client, session.lease_id) == -1

    run(face, scenario)


def test_a_burst_of_waiters_of_one_process_keeps_a_window_of_watches_and_holds_in_order(
    face: Face, own_etcd: EtcdCluster, name: str
) -> None:
    """30 acquires of one semaphore at max 1, created at once on one session behind a
    holder: only as many waiters as the window holds read and watch (conch.core.line; each
    watched the key ahead of it before, 30 watches and 30 reads of every key); the rest are
    queued in etcd all the same, and all 30 hold in the order of their keys (the threaded
    face: one thread each, of run_at's 32)."""
    count = 30

    async def scenario(fclient: Any) -> None:
        with own_etcd.client() as client:
            sema = face.semaphore(fclient, name, max=1)
            holder = await face.acquire(sema, 10)
            async with face.session(fclient, ttl=10) as session:
                held: list[int] = []

                async def turn() -> None:
                    hold = await face.acquire(sema, 60, session)
                    held.append(hold.revision)
                    await face.release(hold)

                turns = [asyncio.ensure_future(turn()) for _ in range(count)]
                await _poll(lambda: len(sema_keys(client, name)) == count + 1, "all queued")
                # The holder's guard and the window's two waiters, once the watches of the
                # first reads have settled: never a watch per waiter. Up to two more: the
                # first two to join read in their enqueue's Txn, and under threads a later
                # joiner's key can land before theirs, so it is among the first two too.
                bound = 1 + 2 * 2
                await _poll(lambda: etcd_watchers(own_etcd) <= bound, "a window of watches")
                # An observation window: the bound holds on, not only before watches were made.
                until = time.monotonic() + 0.5
                while time.monotonic() < until:
                    assert etcd_watchers(own_etcd) <= bound
                    await asyncio.sleep(0.05)
                queued = revisions(client, name)[1:]
                await face.release(holder)
                await asyncio.wait_for(asyncio.gather(*turns), DEADLINE)
                assert held == queued
                assert sema_keys(client, name) == []

    run_at(face.at(own_etcd), scenario)


def test_a_shared_session_lost_while_queued_raises_session_lost(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        holder = face.semaphore(fclient, name, max=1)
        async with face.holding(holder, timeout=10), face.session(fclient) as session:
            waiting = asyncio.ensure_future(
                face.acquire(face.semaphore(fclient, name, max=1), None, session)
            )
            await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
            lease.revoke(client, session.lease_id)
            with pytest.raises(conch.SessionLost):
                await asyncio.wait_for(waiting, DEADLINE)

    run(face, scenario)
    assert sema_keys(client, name) == []


@pytest.mark.parametrize("shared", [False, True], ids=["own-session", "shared-session"])
def test_an_interrupted_wait_withdraws_its_key(
    face: Face, client: Client, name: str, shared: bool
) -> None:
    async def scenario(fclient: Any) -> None:
        holder = face.semaphore(fclient, name, max=1)
        async with contextlib.AsyncExitStack() as stack:
            hold = await stack.enter_async_context(face.holding(holder, timeout=10))
            session = await stack.enter_async_context(face.session(fclient)) if shared else None
            raised = await face.interrupt_waiting(
                face.semaphore(fclient, name, max=1),
                lambda: len(sema_keys(client, name)) == 2,
                session,
            )
            assert isinstance(raised, face.interrupted), raised
            # No poll: the waiter's key is gone by the time the wait has ended.
            assert revisions(client, name) == [hold.revision]

    run(face, scenario)
    assert sema_keys(client, name) == []


def test_a_waiter_takes_the_slot_when_the_holder_releases(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        first = await face.acquire(face.semaphore(fclient, name, max=1), timeout=10)
        waiting = asyncio.ensure_future(face.acquire(face.semaphore(fclient, name, max=1)))
        await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
        await face.release(first)
        second = await asyncio.wait_for(waiting, DEADLINE)
        assert second.revision > first.revision
        assert revisions(client, name) == [second.revision]
        await face.release(second)

    run(face, scenario)


def test_expires_at_is_the_last_keepalive_plus_the_ttl(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        before = time.monotonic()
        hold = await face.acquire(face.semaphore(fclient, name, max=1, ttl=3), timeout=10)
        first = face.expires_at(hold)
        assert before + 3 <= first + 0.001 and first <= time.monotonic() + 3
        # The same instant (a keepalive between two reads may only move it on).
        before_read, read, after_read = hold.deadline, face.expires_at(hold), hold.deadline
        assert before_read <= read <= after_read
        # A keepalive every TTL/3 moves it on.
        await _poll(lambda: face.expires_at(hold) > first, "a keepalive")
        await face.release(hold)
        assert face.expires_at(hold) == 0.0  # released: an instant long past

    run(face, scenario)


@pytest.mark.parametrize("shared", [False, True], ids=["own-session", "shared-session"])
def test_a_hold_dropped_without_release_is_released_when_collected(
    face: Face, own_etcd: EtcdCluster, name: str, shared: bool
) -> None:
    """``del hold; gc.collect()`` while its guard watches: a ResourceWarning, and the key
    goes at once (the TTL of 30 s is not what frees it); a shared session lives on."""
    here = face.at(own_etcd)

    async def scenario(fclient: Any) -> None:
        async with contextlib.AsyncExitStack() as stack:
            client = stack.enter_context(own_etcd.client())
            session = await stack.enter_async_context(face.session(fclient, 30)) if shared else None
            sema = face.semaphore(fclient, name, max=1, ttl=30)
            watching = await asyncio.to_thread(etcd_watchers, own_etcd)
            hold = await face.acquire(sema, 10, session)
            lease_id = hold.lease_id
            await _poll(lambda: etcd_watchers(own_etcd) > watching, "the guard's watch")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                del hold
                gc.collect()
            assert any(issubclass(w.category, ResourceWarning) for w in caught), caught
            await _poll(lambda: sema_keys(client, name) == [], "the hold released", timeout=10)
            expected_ttl_left = lease.time_to_live(client, lease_id)
            assert (expected_ttl_left > 0) if shared else (expected_ttl_left == -1)

    run(here, scenario)


def test_a_hold_whose_key_is_deleted_by_hand_is_lost(face: Face, client: Client, name: str) -> None:
    """The guard's watch on our key: its deletion (the lease itself lives on) loses the hold."""

    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1, ttl=30), timeout=10)
        [key] = sema_keys(client, name)
        kv.delete(client, key.key)
        await face.wait_lost(hold)
        with pytest.raises(conch.HoldLost):
            await face.check(hold)
        await face.release(hold)

    run(face, scenario)


def test_a_waiter_whose_own_session_is_lost_re_enters_and_still_gets_the_slot(
    face: Face, client: Client, name: str
) -> None:
    """A private session lost while queued: a new lease, a new key at the back of the queue
    (design page: queue position is not kept), and the wait goes on."""

    async def scenario(fclient: Any) -> None:
        first = await face.acquire(face.semaphore(fclient, name, max=1), timeout=10)
        waiting = asyncio.ensure_future(face.acquire(face.semaphore(fclient, name, max=1)))
        await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
        [_, queued] = sema_keys(client, name)
        lease.revoke(client, queued.lease)
        await _poll(
            lambda: [k.lease for k in sema_keys(client, name)][1:] not in ([], [queued.lease]),
            "the waiter re-entered",
        )
        [_, again] = sema_keys(client, name)
        assert again.create_revision > queued.create_revision
        await face.release(first)
        second = await asyncio.wait_for(waiting, DEADLINE)
        assert (second.revision, second.lease_id) == (again.create_revision, again.lease)
        await face.release(second)

    run(face, scenario)
    assert sema_keys(client, name) == []


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A one-member etcd of this module's own, which a test may kill and start again."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("restartable"))
    cluster.start()
    yield cluster
    cluster.stop()


def test_a_waiter_keeps_its_place_while_etcd_is_away_for_a_moment(
    face: Face, restartable: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd killed while a waiter queues (its standing read with its enqueue, watching the
    holder), and back with its data within the leases' TTL (30 s) once the waiter has met
    the refused connection: its lease lived through it, so it keeps its key (no re-entry at
    the back of the queue) and takes the slot with it when the holder leaves."""
    caplog.set_level(logging.INFO, logger="conch")
    here = face.at(restartable, request_timeout=0.5)
    member = restartable.members[0]

    async def scenario(fclient: Any) -> None:
        with restartable.client() as client:
            first = await here.acquire(here.semaphore(fclient, name, max=1, ttl=30), timeout=10)
            sema = here.semaphore(fclient, name, max=1, ttl=30)
            waiting = asyncio.ensure_future(here.acquire(sema))
            await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter's key")
            [_, queued] = sema_keys(client, name)
        member.kill()
        await _poll(lambda: "event=etcd-away" in caplog.text, "the waiter's read refused")
        member.start(restartable.initial_cluster)
        await asyncio.to_thread(restartable.wait_healthy)
        await here.release(first)
        second = await asyncio.wait_for(waiting, DEADLINE)
        assert (second.revision, second.lease_id) == (queued.create_revision, queued.lease)
        with restartable.client() as client:
            assert [k.create_revision for k in sema_keys(client, name)] == [second.revision]
        await here.release(second)

    async def main() -> None:
        async with here.connect() as fclient:
            await scenario(fclient)

    asyncio.run(main())


def test_closing_the_client_revokes_the_leases_still_open_on_it(
    face: Face, client: Client, name: str
) -> None:
    """A hold and a waiter left open when the client closes: their keys go at once (the
    leases revoked), not after the TTL of 30 s."""

    left_open: list[Any] = []  # kept referenced: a dropped hold would be released

    async def scenario(fclient: Any) -> None:
        sema = face.semaphore(fclient, name, max=1, ttl=30)
        left_open.append(await face.acquire(sema, timeout=10))
        left_open.append(asyncio.ensure_future(face.acquire(sema)))
        await _poll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
        # Leaving run()'s block closes the client, the hold and the waiter still open.

    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the hold is dropped with the loop
        run(face, scenario)
    assert sema_keys(client, name) == []
    assert time.monotonic() - started < 15


# -- an auth token that expires ------------------------------------------------------------

TOKEN_TTL = 2  # seconds: etcd forgets a simple token left unused for this long
PAST_TOKEN = TOKEN_TTL + 1.5  # etcd sweeps its expired tokens once a second


@pytest.fixture(scope="module")
def short_token_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A one-member etcd with auth on (user alice) and simple tokens of TOKEN_TTL s."""
    extra = ["--auth-token=simple", f"--auth-token-ttl={TOKEN_TTL}"]
    cluster = EtcdCluster(tmp_path_factory.mktemp("short-token"), extra=extra)
    cluster.start()
    enable_auth(cluster)
    yield cluster
    cluster.stop()


def test_a_holder_and_its_waiters_outlive_their_auth_token_expiring(
    face: Face, short_token_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder and two waiters queued behind it (max=1) on one client, its token left to
    expire (unused for longer than its TTL) before every release: each release meets the
    expired token, the client authenticates again and the call goes through; the waiters
    waited through it, each holds in the order it queued on the key it queued with, no hold
    is lost, and the log has the same events in both faces."""
    caplog.set_level(logging.INFO, logger="conch")
    here = face.at(short_token_etcd, credentials=conch.Credentials("alice", PASSWORD))
    renewed: list[int] = []

    async def release_past_the_token(hold: Any) -> None:
        await asyncio.sleep(PAST_TOKEN)  # the scenario: the token left unused past its life
        await here.check(hold)  # no etcd call: the lease lives on its keepalives
        before = authenticate_calls(short_token_etcd)
        await here.release(hold)
        renewed.append(authenticate_calls(short_token_etcd) - before)

    async def scenario(fclient: Any) -> None:
        with alice(short_token_etcd) as client:
            holder = await here.acquire(here.semaphore(fclient, name, max=1, ttl=10), timeout=10)
            waiting: list[asyncio.Future[Any]] = []
            for queued in (2, 3):
                sema = here.semaphore(fclient, name, max=1, ttl=10)
                waiting.append(asyncio.ensure_future(here.acquire(sema, timeout=60)))
                await _poll(functools.partial(_count_is, client, name, queued), "queued")
            order = revisions(client, name)[1:]
        await release_past_the_token(holder)
        held = []
        for each in waiting:
            hold = await asyncio.wait_for(each, DEADLINE)
            held.append(hold.revision)
            await release_past_the_token(hold)
        assert held == order
        with alice(short_token_etcd) as client:
            assert sema_keys(client, name) == []

    run_at(here, scenario)
    assert len(renewed) == 3 and all(renewed), renewed  # each release authenticated again
    said = said_here(caplog, name)
    events = collections.Counter(event for event, _ in said)
    assert events == {"session": 3, "queued": 2, "acquired": 3, "released": 3}, events
    assert [f["revoked"] for e, f in said if e == "released"] == [True] * 3, said


# -- watches resumed past a compaction ---------------------------------------------------


def test_watches_resumed_past_a_compaction_still_see_the_loss_and_hand_over_in_order(
    face: Face, own_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder and two waiters at max=1, through a proxy, all watching (the holder's
    guard its key, the waiters the semaphore's keys). etcd is compacted past every revision
    their watches still owe, the holder's key is deleted by hand, and their stream breaks
    before the deletion reaches them (the proxy holds it back, then drops the connection).
    Every watch resumes from a revision etcd no longer has and is refused as compacted: the
    guard looks at its key and finds it gone (a watch resumed from the present would never
    see the deletion, one whose refusal went unheard would wait forever), and the waiters
    hold in the order they queued. The same lines in both faces."""
    caplog.set_level(logging.INFO, logger="conch")
    proxy = DelayProxy(("127.0.0.1", own_etcd.members[0].client_port), delay=0.0)
    here = face.at(own_etcd)
    here.endpoints = f"127.0.0.1:{proxy.port}"

    async def scenario(fclient: Any) -> None:
        with own_etcd.client() as client:
            holder = await here.acquire(here.semaphore(fclient, name, max=1, ttl=30), timeout=10)
            waiting: list[asyncio.Future[Any]] = []
            for queued in (2, 3):
                sema = here.semaphore(fclient, name, max=1, ttl=30)
                waiting.append(asyncio.ensure_future(here.acquire(sema)))
                await _poll(functools.partial(_count_is, client, name, queued), "queued")
            order = revisions(client, name)[1:]
            await _poll(lambda: etcd_watchers(own_etcd) == 3, "the guard's and waiters' watches")
            # The holder, held from its key's creation, owes no touch (TouchOwed.NONE): only
            # its watch can see the loss.
            assert touched(client, name) is False
            proxy.delay = 5.0
            for i in range(3):
                kv.put(client, f"/churn/{name}/{i}".encode(), b"x")
            now = kv.put(client, f"/churn/{name}".encode(), b"x").header.revision
            client.call("kv", "Compact", rpc_pb2.CompactionRequest(revision=now))
            kv.delete(client, sema_keys(client, name)[0].key)
            proxy.cut()
            proxy.delay = 0.0
            await here.wait_lost(holder)
            second = await asyncio.wait_for(waiting[0], DEADLINE)
            await here.release(holder)
            assert revisions(client, name)[0] == second.revision == order[0]
            await here.release(second)
            third = await asyncio.wait_for(waiting[1], DEADLINE)
            assert third.revision == order[1]
            await here.release(third)
            assert sema_keys(client, name) == []

    try:
        run_at(here, scenario)
    finally:
        proxy.close()
    said = said_here(caplog, name)
    rewatches = [fields["reason"] for event, fields in said if event == "rewatch"]
    assert all("compacted" in reason for reason in rewatches), rewatches
    # Found by the guard's look at its key, after its watch was refused as compacted.
    assert [fields["reason"] for event, fields in said if event == "lost"] == [
        "our key was deleted"
    ]
    events = collections.Counter(event for event, _ in said if event != "rewatch")
    assert events == {"session": 3, "acquired": 3, "queued": 2, "lost": 1, "released": 3}, events


# -- etcd's space alarm (NOSPACE) ----------------------------------------------------------

QUOTA = "--quota-backend-bytes=4194304"  # 4 MiB: filled in a second


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A one-member etcd of this test's own with a small space quota, filled by the test."""
    cluster = EtcdCluster(tmp_path / "small", extra=[QUOTA])
    cluster.start()
    yield cluster
    cluster.stop()


def fill_until_refused(client: Client) -> None:
    """Write junk until etcd raises its space alarm ("database space exceeded")."""
    blob = b"x" * 256 * 1024
    for i in range(200):
        try:
            kv.put(client, f"/fill/{i}".encode(), blob)
        except conch.EtcdError as exc:
            assert "database space exceeded" in str(exc), exc
            return
    raise AssertionError("etcd's quota never refused a write")


HOLD_FOR = 0.6  # seconds each waiter holds (the job's length): over the holder's TOUCH_DELAY


def test_under_the_space_alarm_six_waiters_behind_a_holder_all_hold_in_order(
    face: Face, small_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder and six waiters queued at max=1, then etcd's space alarm (writes refused,
    Ranges served, read-only Txns refused too), then the holder releases: the waiter at the
    head holds from the release's event; the ones behind the window, woken by their
    predecessor's deletion, read their standing as Ranges pinned to one revision; the
    touches (the waiters' and the new holders') are refused and retried, and lose nothing.
    All six hold in the order they queued, with no re-entry and no hold lost. Before, the
    asyncio face's standing read had no fallback: two held, the other four logged
    ``etcd-away`` until their timeout (NoSlot)."""
    caplog.set_level(logging.INFO, logger="conch")
    here = face.at(small_etcd)

    async def scenario(fclient: Any) -> None:
        with small_etcd.client() as client:
            holder = await here.acquire(here.semaphore(fclient, name, max=1, ttl=30), timeout=10)
            waiting: list[asyncio.Future[Any]] = []
            for queued in range(2, 8):
                sema = here.semaphore(fclient, name, max=1, ttl=30)
                waiting.append(asyncio.ensure_future(here.acquire(sema, timeout=40)))
                await _poll(functools.partial(_count_is, client, name, queued), "queued")
            order = revisions(client, name)[1:]
            await asyncio.to_thread(fill_until_refused, client)
            caplog.clear()
            await here.release(holder)
            held = []
            for each in waiting:
                hold = await asyncio.wait_for(each, DEADLINE)
                held.append(hold.revision)
                await asyncio.sleep(HOLD_FOR)  # the job
                await here.check(hold)
                await here.release(hold)
            assert held == order
            await _poll(lambda: sema_keys(client, name) == [], "every key gone")

    run_at(here, scenario)
    events = {event for event, _ in said_here(caplog, name)}
    assert events == {"acquired", "released", "touch-failed"}, events


def refused_for_space(cluster: EtcdCluster) -> int:
    """The Txns etcd's first member has refused so far with ResourceExhausted (its space
    alarm), from its Prometheus metrics (``grpc_server_handled_total``)."""
    import urllib.request

    url = f"http://{cluster.members[0].endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    wanted = ('grpc_code="ResourceExhausted"', 'grpc_method="Txn"')
    counts = [
        int(float(line.rsplit(" ", 1)[1]))
        for line in lines
        if line.startswith("grpc_server_handled_total{") and all(w in line for w in wanted)
    ]
    return sum(counts)


def test_touch_failed_is_logged_once_per_run_of_refused_touches_not_per_retry(
    face: Face, small_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter with two keys ahead (max 1: in the window, too far back to touch) that takes
    the slot when both go in one revision, under etcd's space alarm, owes the waiter behind
    it the touch TOUCH_DELAY in: etcd refuses that Txn, and the guard retries it after a
    pause, again and again, without losing the hold. ``touch-failed`` is logged once for
    that run of failures, not on every retry (the alarm may last hours)."""
    caplog.set_level(logging.INFO, logger="conch")
    here = face.at(small_etcd)

    async def scenario(fclient: Any) -> None:
        with small_etcd.client() as client:
            # Two keys ahead of ours, both on one lease: its revoke deletes them at once.
            ahead = lease.grant(client, 30).id
            for lease_id in (ahead, lease.grant(client, 30).id):
                kv.put(client, keys.holder_key(name, 1, lease_id), b"", ahead)
            sema = here.semaphore(fclient, name, max=1, ttl=30)
            waiting = asyncio.ensure_future(here.acquire(sema, timeout=40))
            await _poll(functools.partial(_count_is, client, name, 3), "queued")
            await asyncio.to_thread(fill_until_refused, client)
            lease.revoke(client, ahead)
            hold = await asyncio.wait_for(waiting, DEADLINE)
            before = await asyncio.to_thread(refused_for_space, small_etcd)
            deadline = time.monotonic() + DEADLINE
            while await asyncio.to_thread(refused_for_space, small_etcd) < before + 4:
                assert time.monotonic() < deadline, "the refused touch was not retried"
                await asyncio.sleep(0.1)
            await here.check(hold)
            await here.release(hold)

    run_at(here, scenario)
    said = [str(f["error"]) for e, f in said_here(caplog, name) if e == "touch-failed"]
    assert len(said) == 1, said
    assert "database space exceeded" in said[0], said


def touched(client: Client, name: str) -> bool:
    """The semaphore's first key was put again since it was made (a holder's touch)."""
    first = sema_keys(client, name)[0]
    return bool(first.mod_revision > first.create_revision)


def said_here(
    caplog: pytest.LogCaptureFixture, name: str, level: int = logging.DEBUG
) -> list[tuple[str, dict[str, Any]]]:
    """The conch events captured at ``level`` or above, (event, fields), of this test's
    semaphore ``name`` and of the sessions whose ``session`` line was captured: a hold or
    session another test left to the collector may log here (its hold-dropped and
    session-dropped were counted once, in a loaded run)."""
    said = [
        (r.__dict__["conch_event"], r.__dict__["conch_fields"], r.levelno)
        for r in caplog.records
        if "conch_event" in r.__dict__
    ]
    leases = {fields["lease"] for event, fields, _ in said if event == "session"}
    return [
        (event, fields)
        for event, fields, levelno in said
        if levelno >= level
        and (
            fields.get("name") == name
            or name in str(fields.get("key", ""))
            or fields.get("lease") in leases
        )
    ]


def _count_is(client: Client, name: str, count: int) -> bool:
    return len(sema_keys(client, name)) == count


def run_at(here: Face, scenario: Callable[[Any], Awaitable[None]]) -> None:
    """``run`` with a client of ``here`` (a face at another etcd), and threads enough for
    the threaded face's blocking calls (each on a thread) to all wait at once."""

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
        async with here.connect() as fclient:
            await scenario(fclient)

    asyncio.run(main())
