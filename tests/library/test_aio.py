"""conch.aio, the asyncio API, against a real etcd: cancellation leaves no key, the loop never
blocks and never needs its default executor, a loss reaches the coroutines."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import conch
import conch.aio
from conch.etcd import Client, Endpoint, lease
from tests.conftest import DEADLINE, poll, sema_keys
from tests.delayproxy import FaultProxy, Gate
from tests.etcd_server import EtcdCluster

ROOT = Path(__file__).resolve().parents[2]


async def apoll(check: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    """``tests.conftest.poll`` for coroutines: the loop keeps running between checks."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)  # the poll's interval, within its deadline


def run(
    etcd: EtcdCluster,
    body: Callable[[conch.aio.Client], Awaitable[None]],
    via: FaultProxy | None = None,
) -> None:
    """Run ``body(client)`` in a new event loop, with a conch.aio client of the test etcd
    (through the proxy ``via``, if given)."""

    async def main() -> None:
        async with conch.aio.connect(etcd.endpoints if via is None else via.endpoint) as client:
            await body(client)

    asyncio.run(main())


async def open_once_held(gate: Gate) -> None:
    """Open ``gate`` once it holds a request: etcd slow to answer it, while the loop runs
    on (a cancel that did not wait for the request would propagate meanwhile)."""
    await apoll(gate.reached.is_set, "the held request")
    gate.open()


def test_async_with_holds_a_slot_and_releases_it(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    async def body(aclient: conch.aio.Client) -> None:
        sema = conch.aio.Semaphore(aclient, name, max=2, ttl=5)
        async with sema.acquire(timeout=10) as hold:
            [key] = sema_keys(client, name)
            assert (hold.revision, hold.lease_id) == (key.create_revision, key.lease)
            assert not hold.lost.is_set()
            await hold.check()
            records = await conch.aio.who(aclient, name)
            assert [(r.state, r.rev) for r in records] == [("HELD", hold.revision)]
        assert sema_keys(client, name) == []

    run(etcd, body)


def test_nonblocking_acquire_raises_no_slot_and_leaves_no_key(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    async def body(aclient: conch.aio.Client) -> None:
        async with conch.aio.Semaphore(aclient, name, max=1).acquire(timeout=10) as hold:
            with pytest.raises(conch.NoSlot):
                await conch.aio.Semaphore(aclient, name, max=1).acquire(timeout=0)
            assert [k.create_revision for k in sema_keys(client, name)] == [hold.revision]

    run(etcd, body)
    assert sema_keys(client, name) == []


async def _cancel_by_task_cancel(waiting: Coroutine[Any, Any, None], queued: asyncio.Event) -> None:
    task = asyncio.create_task(waiting)
    await queued.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _cancel_by_asyncio_timeout(
    waiting: Coroutine[Any, Any, None], queued: asyncio.Event
) -> None:
    async def expire_once_queued(scope: asyncio.Timeout) -> None:
        await queued.wait()
        scope.reschedule(asyncio.get_running_loop().time())

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as scope:
            expiry = asyncio.create_task(expire_once_queued(scope))
            await waiting
    await expiry


async def _cancel_by_wait_for(waiting: Coroutine[Any, Any, None], queued: asyncio.Event) -> None:
    # wait_for's clock cannot wait for the queueing: 2 s is plenty for it (a LeaseGrant and
    # a Txn); a waiter not queued by then must leave no key all the same.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(waiting, 2.0)


@pytest.mark.parametrize(
    "cancel",
    [
        _cancel_by_task_cancel,
        pytest.param(
            _cancel_by_asyncio_timeout,
            marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout: 3.11"),
        ),
        _cancel_by_wait_for,
    ],
)
def test_cancelling_a_waiting_acquire_withdraws_its_key_before_the_cancel_propagates(
    etcd: EtcdCluster,
    client: Client,
    name: str,
    cancel: Callable[[Coroutine[Any, Any, None], asyncio.Event], Awaitable[None]],
    proxies: Callable[[], FaultProxy],
) -> None:
    """The withdrawal (the waiter's LeaseRevoke) is held at the proxy until the loop has run
    on: one not awaited before the cancel propagates leaves the waiter's key behind."""
    proxy, gate = proxies(), Gate()
    proxy.before("LeaseRevoke", gate)

    async def body(aclient: conch.aio.Client) -> None:
        opener = asyncio.create_task(open_once_held(gate))
        sema = conch.aio.Semaphore(aclient, name, max=1, ttl=5)
        async with sema.acquire(timeout=10) as holder:
            queued = asyncio.Event()
            entered: list[conch.aio.Hold] = []

            async def waiting() -> None:
                async with sema.acquire() as hold:
                    entered.append(hold)

            async def watch_queue() -> None:
                await apoll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
                queued.set()

            watcher = asyncio.create_task(watch_queue())
            await cancel(waiting(), queued)
            watcher.cancel()
            # No poll: the waiter's key must be gone by the time the cancel has propagated.
            assert [k.create_revision for k in sema_keys(client, name)] == [holder.revision]
            assert entered == [] and gate.reached.is_set()
        opener.cancel()

    run(etcd, body, via=proxy)
    assert sema_keys(client, name) == []


def test_a_slot_granted_just_as_the_cancel_arrives_is_released(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """The recipe grants the slot, then (before the hold reaches the awaiting coroutine) the
    task is cancelled: the hold must be released before the CancelledError leaves it.

    The window, made certain through the loop's own seam (its task factory): ``acquire``
    drives the recipe in a task of its own and awaits it; the test's done callback on that
    task, registered first, cancels the waiting task the moment the recipe's outcome is in,
    before ``acquire`` sees it."""
    holder = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    entered: list[conch.aio.Hold] = []
    granted: list[object] = []

    async def body(aclient: conch.aio.Client) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Task[None] | None = None

        def cancel_once_done(driving: asyncio.Future[Any]) -> None:
            if driving.cancelled() or driving.exception() is not None or granted:
                return
            granted.append(driving.result())
            assert waiter is not None
            waiter.cancel()

        def task_factory(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop)
            if waiter is not None and asyncio.current_task() is waiter:
                task.add_done_callback(cancel_once_done)  # a task acquire made: the recipe
            return task

        async def waiting() -> None:
            async with conch.aio.Semaphore(aclient, name, max=1, ttl=5).acquire() as hold:
                entered.append(hold)

        loop.set_task_factory(task_factory)
        waiter = asyncio.create_task(waiting())
        await apoll(lambda: len(sema_keys(client, name)) == 2, "the waiter queued")
        holder.release()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, DEADLINE)
        loop.set_task_factory(None)
        assert [type(g) for g in granted] == [conch.core.messages.Held]
        assert sema_keys(client, name) == []
        assert entered == []

    run(etcd, body)


def test_cancelling_a_task_inside_its_hold_releases_before_the_cancel_propagates(
    etcd: EtcdCluster, client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """The release (the hold's LeaseRevoke) is held at the proxy until the loop has run on:
    one not awaited before the cancel propagates leaves the key behind."""
    proxy, gate = proxies(), Gate()
    proxy.before("LeaseRevoke", gate)

    async def body(aclient: conch.aio.Client) -> None:
        opener = asyncio.create_task(open_once_held(gate))
        inside = asyncio.Event()

        async def holding() -> None:
            async with conch.aio.Semaphore(aclient, name, max=1, ttl=5).acquire(10):
                inside.set()
                await asyncio.Event().wait()  # until cancelled

        task = asyncio.create_task(holding())
        await asyncio.wait_for(inside.wait(), DEADLINE)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sema_keys(client, name) == []
        assert gate.reached.is_set()
        opener.cancel()

    run(etcd, body, via=proxy)


async def _contend(aclient: conch.aio.Client, name: str, tasks: int, max_holders: int) -> int:
    """``tasks`` tasks each take one of ``max_holders`` slots once, briefly; returns the most
    that were inside at once."""
    inside = most = 0

    async def one() -> None:
        nonlocal inside, most
        async with conch.aio.Semaphore(aclient, name, max=max_holders, ttl=5).acquire(
            timeout=DEADLINE
        ) as hold:
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.02)  # the job's length inside the slot (the scenario)
            await hold.check()
            inside -= 1

    await asyncio.gather(*(one() for _ in range(tasks)))
    return most


def test_a_one_worker_default_executor_kept_busy_does_not_stall_contending_tasks(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """The loop's default executor has one worker, and it is busy for the whole test: any
    call of conch.aio that needed it would hang."""
    unblock = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        blocker = loop.run_in_executor(None, unblock.wait, DEADLINE * 4)

        async def contend() -> None:
            async with conch.aio.connect(etcd.endpoints) as aclient:
                assert await _contend(aclient, name, tasks=10, max_holders=2) == 2
                assert await conch.aio.who(aclient, name) == []

        try:
            await asyncio.wait_for(contend(), DEADLINE * 2)
        finally:
            unblock.set()
            await blocker

    asyncio.run(main())
    assert sema_keys(client, name) == []


@pytest.mark.alone
def test_the_loop_keeps_ticking_while_twenty_tasks_contend(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """A 10 ms ticker runs beside 20 tasks taking one slot in turn; its worst lateness is the
    loop's worst stall (a blocking call to etcd on the loop would stall it for the call)."""
    lags: list[float] = []

    async def body(aclient: conch.aio.Client) -> None:
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                before = time.monotonic()
                await asyncio.sleep(0.01)  # the tick whose lateness is measured
                lags.append(time.monotonic() - before - 0.01)

        ticking = asyncio.create_task(ticker())
        try:
            assert await _contend(aclient, name, tasks=20, max_holders=1) == 1
        finally:
            done.set()
            await ticking

    run(etcd, body)
    print(f"loop lag over {len(lags)} ticks: max {max(lags) * 1000:.1f} ms")
    assert max(lags) < 0.5
    assert sema_keys(client, name) == []


def test_an_outside_revoke_sets_lost_then_check_and_leaving_raise_hold_lost(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    reasons: list[str] = []

    async def body(aclient: conch.aio.Client) -> None:
        sema = conch.aio.Semaphore(aclient, name, max=1, ttl=5)
        with pytest.raises(conch.HoldLost):
            async with sema.acquire(timeout=10) as hold:
                hold.on_lost(reasons.append)
                lease.revoke(client, hold.lease_id)
                await asyncio.wait_for(hold.lost.wait(), DEADLINE)
                with pytest.raises(conch.HoldLost):
                    await hold.check()
                await apoll(lambda: reasons, "the on_lost callback")
                assert hold.reason == reasons[0]

    run(etcd, body)
    assert sema_keys(client, name) == []


def test_leaving_after_a_loss_lets_the_body_s_own_exception_through(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    class Failed(Exception):
        pass

    async def body(aclient: conch.aio.Client) -> None:
        with pytest.raises(Failed):
            async with conch.aio.Semaphore(aclient, name, max=1, ttl=5).acquire(10) as hold:
                lease.revoke(client, hold.lease_id)
                await asyncio.wait_for(hold.lost.wait(), DEADLINE)
                raise Failed

    run(etcd, body)
    assert sema_keys(client, name) == []


def test_a_hold_that_outlives_its_loop_leaves_no_key_past_its_ttl(
    etcd: EtcdCluster, client: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hold lives on its loop: when asyncio.run ends, its keepalive task ends with it, so
    the lease expires within its TTL (nothing keeps a slot for a loop that is gone), and
    nothing fails noisily on the way."""

    async def take() -> conch.aio.Hold:
        aclient = await conch.aio.connect(etcd.endpoints)  # outlives the loop, as the hold
        hold = await conch.aio.Semaphore(aclient, name, max=1, ttl=2).acquire(10)
        hold.on_lost(print)
        return hold

    hold = asyncio.run(take())
    assert [k.lease for k in sema_keys(client, name)] == [hold.lease_id]
    poll(lambda: sema_keys(client, name) == [], what="the lease expired")
    assert "callback-failed" not in caplog.text


def test_cancelling_a_dial_returns_at_once(etcd: EtcdCluster) -> None:
    """The dial cannot be interrupted; the cancel does not wait for it (the client it makes,
    if any, is closed when it comes)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{unused.getsockname()[1]}"  # nothing listens there

        async def main() -> float:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(conch.aio.connect(endpoint, dial_timeout=10), 0.2)
            return time.monotonic() - started

        assert asyncio.run(main()) < 5


class ExampleService:
    """One ``examples/asyncio_service.py`` process on a free port."""

    def __init__(self, etcd: EtcdCluster, name: str, journal: Path, log: Path) -> None:
        cmd = [sys.executable, str(ROOT / "examples" / "asyncio_service.py")]
        cmd += ["--endpoints", etcd.endpoints, "--name", name, "--port", "0"]
        cmd += ["--journal", str(journal)]
        with log.open("wb") as err:
            self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.process.stdout is not None
        self.stdout = self.process.stdout
        self.port = int(self.stdout.readline().rsplit(":", 1)[1])

    def get(self) -> str:
        """One request; the status line and the body."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE * 2) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            answer = b"".join(iter(lambda: conn.recv(4096), b"")).decode()
        head, _, body = answer.partition("\r\n\r\n")
        return f"{head.splitlines()[0]} {body.strip()}"

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(DEADLINE)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def services(etcd: EtcdCluster, tmp_path: Path, name: str) -> Iterator[list[ExampleService]]:
    started = [
        ExampleService(etcd, name, tmp_path / "journal", tmp_path / f"service-{i}.log")
        for i in range(2)
    ]
    yield started
    for service in started:
        service.kill()
    for i in range(2):  # shown by pytest only when the test failed
        print(f"--- service {i}\n{(tmp_path / f'service-{i}.log').read_text(errors='replace')}")


def test_example_service_answers_ten_concurrent_requests_each_without_overlap(
    services: list[ExampleService], client: Client, tmp_path: Path, name: str
) -> None:
    """Two instances, ten concurrent requests to each, one slot: every request is served
    (none times out, nothing deadlocks on the one-worker default executor), and the journal
    shows the critical sections one after another, tokens rising."""
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda s: s.get(), services * 10))
    assert all(a.startswith("HTTP/1.0 200 OK token=") for a in answers), answers
    assert [s.stop() for s in services] == [0, 0]
    lines = [line.split() for line in (tmp_path / "journal").read_text().splitlines()]
    tokens = [int(fields[2].split("=")[1]) for fields in lines]
    runs = [tokens[i : i + 5] for i in range(0, 100, 5)]
    assert len(lines) == 100 and all(len(set(run)) == 1 for run in runs)
    assert [run[0] for run in runs] == sorted(set(tokens))
    assert sema_keys(client, name) == []


def test_example_service_stopped_with_requests_waiting_leaves_no_key(
    services: list[ExampleService], client: Client, name: str
) -> None:
    holder = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(services[i % 2].get) for i in range(6)]
        poll(lambda: len(sema_keys(client, name)) == 7, what="six requests queued")
        assert [s.stop() for s in services] == [0, 0]
        # Each handler was cancelled while waiting, and says so.
        assert {a.result(DEADLINE) for a in answers} == {
            "HTTP/1.0 503 Service Unavailable stopping"
        }
    assert [k.create_revision for k in sema_keys(client, name)] == [holder.revision]
    holder.release()


@pytest.mark.alone
def test_two_hundred_waiting_acquires_cost_the_threads_of_ten_and_the_loop_stays_responsive(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """Waiters on one client, each on a session of its own, queued behind one holder: the
    process's threads are the same at 200 waiters as at 10 (the client's streams and their
    readers, gRPC's own; none per waiter), and while they wait (keepalives, watches) a 10 ms
    ticker is never late by half a second. On the code before, each waiter had a thread."""
    lags: list[float] = []

    async def queued(aclient: conch.aio.Client, count: int) -> None:
        async def all_there() -> bool:
            return len(await conch.aio.who(aclient, name)) == count + 1

        deadline = time.monotonic() + DEADLINE * 2
        while not await all_there():
            assert time.monotonic() < deadline, f"{count} waiters not queued in time"
            await asyncio.sleep(0.1)  # the poll's interval, within its deadline

    async def tick_for(window: float) -> None:
        """An observation window: a 10 ms ticker, its lateness measured, for ``window`` s."""
        end = time.monotonic() + window
        while time.monotonic() < end:
            before = time.monotonic()
            await asyncio.sleep(0.01)  # the tick whose lateness is measured
            lags.append(time.monotonic() - before - 0.01)

    async def body(aclient: conch.aio.Client) -> None:
        # TTL 6 s: at 3 s a loaded machine once let the holder's lease expire among 200,
        # and waiters entered while the test still held the slot.
        ttl = 6
        sema = conch.aio.Semaphore(aclient, name, max=1, ttl=ttl)
        # Each window is one keepalive period (TTL/3) and a margin: every lease is kept
        # alive once within it, whenever it was granted.
        window = ttl / 3 + 0.5
        entered: list[conch.aio.Hold] = []

        async def waiting() -> None:
            async with sema.acquire() as hold:
                entered.append(hold)

        async with sema.acquire(timeout=10):
            tasks = [asyncio.create_task(waiting()) for _ in range(10)]
            await queued(aclient, 10)
            await tick_for(window)  # past a keepalive of each
            at_ten = threading.active_count()
            tasks += [asyncio.create_task(waiting()) for _ in range(190)]
            await queued(aclient, 200)
            lags.clear()
            await tick_for(window)  # the waiting, measured: keepalives of 200 leases, 200 watches
            at_two_hundred = threading.active_count()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert entered == []
        print(f"threads: {at_ten} at 10 waiters, {at_two_hundred} at 200")
        print(f"loop lag over {len(lags)} ticks: max {max(lags) * 1000:.1f} ms")
        assert at_two_hundred <= at_ten + 2
        assert max(lags) < 0.5

    run(etcd, body)
    assert sema_keys(client, name) == []


def test_cancelling_an_acquire_while_etcd_is_unreachable_ends_it_within_a_second() -> None:
    """No member answers (connection refused at both endpoints), the request timeout is
    30 s: the cancel ends the LeaseGrant's retries at once (as the threaded face's
    interrupt does), not when they run out."""
    with socket.socket() as one, socket.socket() as two:
        one.bind(("127.0.0.1", 0))
        two.bind(("127.0.0.1", 0))
        dead = [Endpoint("127.0.0.1", s.getsockname()[1], False) for s in (one, two)]

        async def main() -> float:
            aclient = conch.aio.Client(Client(dead, request_timeout=30))
            try:
                sema = conch.aio.Semaphore(aclient, "unreachable", max=1)
                task = asyncio.ensure_future(sema.acquire())
                # Where the cancel lands (the scenario, not a synchronisation): 0.5 s into
                # LeaseGrant's retries, which would run 30 s; no state marks a point in them.
                await asyncio.sleep(0.5)
                started = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return time.monotonic() - started
            finally:
                await aclient.close()

        assert asyncio.run(main()) < 1.5
