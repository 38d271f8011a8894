"""The asyncio face's Semaphore: the driver of the waiting recipe on the loop, and who()."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch import errors, keys, log
from conch.aio.client import Client
from conch.aio.hold import Hold
from conch.aio.session import Session
from conch.aio.tasks import T, outlast_cancel, spawn  # noqa: F401
from conch.core import codec, messages, waiter
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import status
from conch.etcd.client import Backoff, check_timeout
from conch.etcd.watch import WatchNotice
from conch.hold import WITHDRAW_TIMEOUT
from conch.identity import Identity
from conch.listing import Record, listing
from conch.semaphore import REENTRY_BACKOFF_CAP, log_acquired, log_note, revision_to_count
from conch.session import check_ttl

# -- the driver of the recipe -------------------------------------------------------------


class _Lost(NamedTuple):
    """A session's loss, as queued: fed to the machine only if it is the current session."""

    lease_id: int
    reason: str


class _Driver:
    """Runs one ``waiter.Waiter`` from a coroutine: executes its actions with awaits
    (unary calls one after another, in the order given), and feeds it their answers and
    the inputs that arrive on the loop (watch notices, a session's loss, the deadline, the
    end of a pause, an interrupt) through one asyncio queue."""

    def __init__(self, sema: Semaphore, timeout: float | None, session: Session | None) -> None:
        self.sema = sema
        self.client = sema.client.sync
        self.loop = asyncio.get_running_loop()
        self.inputs: asyncio.Queue[messages.Input | _Lost] = asyncio.Queue()
        self.interrupted = asyncio.Event()
        self.shared = session
        self.sessions: dict[int, Session] = {}  # private sessions opened, by lease
        self.current_lease = session.lease_id if session is not None else 0
        self.watches: dict[int, etcd_aio.LoopWatch] = {}
        self.timers: list[asyncio.TimerHandle] = []
        self.forget: list[Callable[[], None]] = []
        self.started = time.monotonic()
        self.timeout = timeout
        if session is None:
            self.machine = waiter.Waiter(sema.prefix, sema.max, _pauses())
        else:
            key = sema._key(session.lease_id)
            self.machine = waiter.Waiter(sema.prefix, sema.max, _pauses(), key, session.lease_id)

    def interrupt(self) -> None:
        """From the awaiting coroutine's cancel: stop waiting (the machine withdraws)."""
        self.interrupted.set()  # ends the retries of a call under way
        self.inputs.put_nowait(messages.Interrupt("cancelled"))

    async def run(self) -> messages.Outcome:
        machine = self.machine
        todo = collections.deque(machine.start())
        if self.timeout is not None:
            if self.timeout == 0:
                todo.extend(machine.feed(messages.DeadlineReached()))  # try once, do not wait
            else:
                at = self.loop.time() + self.timeout
                put = self.inputs.put_nowait
                self.timers.append(self.loop.call_at(at, put, messages.DeadlineReached()))
        if self.shared is not None:
            self._subscribe(self.shared)
        answer: messages.Input | _Lost | None
        try:
            while machine.outcome is None or todo:
                # What arrived meanwhile goes in first: a loss or an interrupt ends a wait
                # before its next request, an event is never left behind a slow call.
                while not self.inputs.empty():
                    todo.extend(self._feed(self.inputs.get_nowait()))
                if todo:
                    answer = await self._execute(todo.popleft())
                elif machine.outcome is None:
                    answer = await self.inputs.get()
                else:
                    break
                if answer is not None:
                    todo.extend(self._feed(answer))
            assert machine.outcome is not None
            return machine.outcome
        finally:
            for timer in self.timers:
                timer.cancel()
            for forget in self.forget:
                forget()
            outcome = machine.outcome
            held = outcome if isinstance(outcome, messages.Held) else None
            keep = set(held.retire) if held is not None else set()
            for watch_id in [w for w in self.watches if w not in keep]:
                self.watches.pop(watch_id).cancel()
            # The machine closes every private session it leaves; after a failure of our
            # own (a bug, the loop shutting down), none may be left kept alive.
            left = [
                s for lease, s in self.sessions.items() if held is None or lease != held.lease_id
            ]
            for session in left:
                self.sessions.pop(session.lease_id)
            if left:
                await asyncio.gather(
                    *(s.close(WITHDRAW_TIMEOUT) for s in left), return_exceptions=True
                )

    def _feed(self, item: messages.Input | _Lost) -> list[messages.Action]:
        if isinstance(item, _Lost):
            if item.lease_id != self.current_lease:
                return []  # a session we left
            return self.machine.feed(messages.SessionLost(item.reason))
        return self.machine.feed(item)

    def _subscribe(self, session: Session) -> None:
        lease_id = session.lease_id
        put = self.inputs.put_nowait
        self.forget.append(session._kept.add_listener(lambda reason: put(_Lost(lease_id, reason))))

    async def _execute(self, action: messages.Action) -> messages.Input | None:
        """Do ``action``; its answer (None: it has none, or arrives later on the queue)."""
        if isinstance(action, messages.Note):
            await self._log(action)
            return None
        if isinstance(action, messages.CancelWatch):
            watch = self.watches.pop(action.id, None)
            if watch is not None:
                watch.cancel()
            return None
        if isinstance(action, messages.Pause):
            put = self.inputs.put_nowait
            self.timers.append(
                self.loop.call_later(action.seconds, put, messages.PauseOver(action.id))
            )
            return None
        if isinstance(action, messages.OpenWatch):
            return await self._open_watch(action)
        try:
            return await self._call(action)
        except errors.Interrupted:
            return None  # the interrupt, already queued, is fed next
        except EtcdError as exc:
            return codec.failed(action.id, exc)

    async def _call(self, action: messages.Action) -> messages.Input:
        sema, client = self.sema, self.client
        if isinstance(action, messages.OpenSession):
            session = await Session(sema.client, sema.ttl)._open(self.interrupted)
            self.sessions[session.lease_id] = session
            self.current_lease = session.lease_id
            self._subscribe(session)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, messages.SendEnqueue):
            value = sema.identity.entering().to_json()
            call = codec.enqueue_call(action, sema.prefix, sema.max, value)
            return codec.enqueue_answer(action, await self._send(call), value)
        if isinstance(action, messages.ReadStanding):
            return await sema._read_standing(action, self.interrupted)
        if isinstance(action, messages.ReadKeys):
            reads = codec.keys_reads(action)
            plan = await read_plan(client, self.interrupted)
            return codec.keys_answer(
                action, await read_together(client, reads, plan, self.interrupted)
            )
        if isinstance(action, messages.Touch):
            call = codec.touch_call(action.key, action.revision, action.value, action.lease_id)
            return codec.touch_answer(action, await self._send(call))
        if isinstance(action, messages.CheckLease):
            if self.shared is not None and not self.shared.certainly_alive():
                return messages.LeaseAnswer(action.id, 0)
            ttl = await etcd_aio.time_to_live(
                client, action.lease_id, WITHDRAW_TIMEOUT, self.interrupted
            )
            return messages.LeaseAnswer(action.id, ttl)
        if isinstance(action, messages.Withdraw):
            await self._withdraw(action)
            return messages.Withdrawn(action.id)
        raise AssertionError(f"unknown action {action!r}")

    async def _send(self, call: codec.Call) -> Any:
        return await send(self.client, call, self.interrupted)

    async def _open_watch(self, action: messages.OpenWatch) -> messages.Input | None:
        watch_id = action.id
        put = self.inputs.put_nowait

        def on_notice(notice: WatchNotice) -> None:  # on the loop
            put(codec.watch_input(watch_id, notice))

        key, end, only_deletes = codec.watch_range(action)
        try:
            watch = await etcd_aio.LoopWatch.open(
                self.client, on_notice, key, 0, end, only_deletes=only_deletes, confirm=True
            )
        except EtcdError as exc:
            return codec.failed(watch_id, exc)
        self.watches[watch_id] = watch
        return None

    async def _withdraw(self, action: messages.Withdraw) -> None:
        """Take our key out of the queue, best effort within WITHDRAW_TIMEOUT: a private
        session revoked, else our key deleted (by its create_revision, or, when our
        enqueue's outcome is unknown, if it is on our lease)."""
        if action.revoke:
            session = self.sessions.pop(action.lease_id, None)
            if session is not None:
                await session.close(WITHDRAW_TIMEOUT)
            return
        try:
            await send(self.client, codec.withdraw_call(action), timeout=WITHDRAW_TIMEOUT)
        except EtcdError as exc:
            log.warning("withdraw-failed", name=self.sema.name, error=str(exc))

    async def _log(self, note: messages.Note) -> None:
        """A Note as the log line the threaded face writes for it."""
        sema = self.sema
        revision = revision_to_count(note)
        ahead = None if revision is None else await self._count_ahead(revision)
        log_note(sema.name, sema.max, sema.identity.host, note, ahead)

    async def _count_ahead(self, revision: int) -> int | None:
        """How many keys are ahead of ours, for the ``queued`` line only (None if etcd does
        not say): etcd's count ignores the create_revision filter, so this reads them."""
        request = codec.count_ahead_request(self.sema.prefix, revision)
        try:
            return len((await etcd_aio.range_(self.client, request)).kvs)
        except EtcdError:
            return None

    def raise_for(self, outcome: messages.GaveUp) -> None:
        """Raise what ``outcome`` means to the caller (as ``conch.Semaphore.acquire``)."""
        sema = self.sema
        if outcome.reason == messages.Reason.NO_SLOT:
            raise errors.NoSlot.in_time(sema.name, sema.max, outcome.detail)
        if outcome.reason == messages.Reason.INTERRUPTED:
            raise errors.Interrupted(outcome.cause)
        if outcome.reason == messages.Reason.SESSION_LOST:
            raise errors.SessionLost(outcome.detail)
        failed = outcome.cause
        if isinstance(failed, messages.Failed) and isinstance(failed.cause, BaseException):
            raise failed.cause  # etcd unreachable at the first session (69), or refused
        raise EtcdError(outcome.detail)


def _pauses() -> Backoff:
    """The machine's pauses (before re-entering, reading again): as the threaded face's."""
    return Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)


async def send(
    client: etcd_client.Client,
    call: codec.Call,
    interrupt: asyncio.Event | None = None,
    timeout: float | None = None,
) -> Any:
    """``conch.semaphore.send``, awaited: ``call`` (built by the codec) by the etcd layer's
    call for it (``etcd_aio.txn``, ``etcd_aio.range_``, else ``Client.call_async``)."""
    request = call.request
    if isinstance(request, rpc_pb2.TxnRequest):
        compare, success, failure = list(request.compare), list(request.success), request.failure
        return await etcd_aio.txn(client, compare, success, list(failure), timeout, interrupt)
    if isinstance(request, rpc_pb2.RangeRequest):
        return await etcd_aio.range_(client, request, timeout, interrupt)
    return await client.call_async(call.service, call.method, request, timeout, interrupt=interrupt)


async def read_plan(
    client: etcd_client.Client, interrupt: asyncio.Event | None = None
) -> codec.ReadPlan:
    """``conch.semaphore.read_plan``, awaited (one Status per endpoint and loop at most)."""
    return codec.read_plan(await status.server_version_async(client, interrupt))


async def read_together(
    client: etcd_client.Client,
    reads: list[rpc_pb2.RangeRequest],
    plan: codec.ReadPlan,
    interrupt: asyncio.Event,
) -> codec.Together:
    """``conch.semaphore.read_together``, awaited: Ranges seen at one revision, read by
    ``plan`` (``codec.ReadTogether`` decides, also to go on with pinned Ranges when etcd's
    space alarm refuses the read-only Txn). Raises EtcdError, Interrupted."""
    read = codec.ReadTogether(reads, plan)
    while (call := read.next_call()) is not None:
        try:
            read.answer(await send(client, call, interrupt))
        except EtcdError as exc:
            read.refused(exc)
    return read.result


# -- the semaphore ------------------------------------------------------------------------


class _Acquiring:
    """What ``Semaphore.acquire`` returns: ``async with`` it, or ``await`` it for a Hold to
    release yourself."""

    def __init__(self, sema: Semaphore, timeout: float | None, session: Session | None) -> None:
        self._sema = sema
        self._timeout = timeout
        self._session = session
        self._hold: Hold | None = None

    async def _acquire(self) -> Hold:
        sema, session = self._sema, self._session
        if self._timeout is not None:
            check_timeout("timeout", self._timeout, zero=True)
        if session is not None:
            if session.client is not sema.client:
                raise errors.UsageError("session: belongs to another client than the semaphore")
            key = sema._key(session.lease_id)
            session._claim(key)
        driver = _Driver(sema, self._timeout, session)
        loop = asyncio.get_running_loop()
        driving = loop.create_task(driver.run())
        try:
            outcome = await asyncio.shield(driving)
        except asyncio.CancelledError:
            # Withdraw our key before the cancel propagates; a slot granted just now is
            # released. A second cancel does not cut that short.
            driver.interrupt()
            await outlast_cancel(loop.create_task(_release_if_granted(sema, driver, driving)))
            raise
        except BaseException:
            if session is not None:
                session._unclaim(key)
            raise
        return sema._hold_from(driver, outcome)

    def __await__(self) -> Generator[Any, None, Hold]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Hold:
        self._hold = await self._acquire()
        return self._hold

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hold is not None
        await self._hold.__aexit__(exc_type, exc, traceback)


async def _release_if_granted(
    sema: Semaphore, driver: _Driver, driving: asyncio.Task[messages.Outcome]
) -> None:
    """After an interrupted wait: release the hold if it came all the same. Run as a task of
    its own, so a second cancel cannot stop it between the grant and the release."""
    try:
        outcome = await driving
        hold = sema._hold_from(driver, outcome)
    except errors.ConchError:  # Interrupted, NoSlot...: no key left
        if driver.shared is not None:
            driver.shared._unclaim(sema._key(driver.shared.lease_id))
        return
    await hold.release()


class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``, for coroutines: arguments and
    UsageError as ``conch.Semaphore`` (checked here, no etcd call)."""

    def __init__(
        self,
        client: Client,
        name: str,
        max: int,
        ttl: int = 10,
        spread: bool = False,
        identity: Identity | None = None,
    ) -> None:
        if not isinstance(client, Client):
            raise errors.UsageError(
                f"bad client {client!r}: want a conch.aio.Client (conch.aio.connect(...))"
            )
        keys.check_name(name)
        self.identity = identity or Identity.current()
        keys.check_host(self.identity.host)
        keys.check_max(max)
        check_ttl(ttl)
        self.client = client
        self.name = name
        self.max = max
        self.ttl = ttl
        self.spread = spread
        self.prefix = keys.sema_prefix(name, max)

    def acquire(self, timeout: float | None = None, session: Session | None = None) -> _Acquiring:
        """``async with sema.acquire(timeout) as hold`` (or ``hold = await ...``): wait for a
        slot (``conch.Semaphore.acquire``, the same recipe). ``timeout`` in seconds: None
        waits as long as it takes, 0 tries once. Raises NoSlot when time runs out,
        Unavailable when no session can be established, UsageError for a bad timeout.
        ``session``: a ``conch.aio.Session`` of this client to hold the slot on (a loss
        while queued raises SessionLost). Cancelling the waiting task withdraws our key (or
        releases a slot granted meanwhile) before the CancelledError leaves it."""
        return _Acquiring(self, timeout, session)

    def _key(self, lease_id: int) -> bytes:
        if self.spread:
            return keys.spread_key(self.name, self.max, self.identity.host)
        return keys.holder_key(self.name, self.max, lease_id)

    def _hold_from(self, driver: _Driver, outcome: messages.Outcome) -> Hold:
        if isinstance(outcome, messages.GaveUp):
            driver.raise_for(outcome)
        assert isinstance(outcome, messages.Held)
        shared = driver.shared is not None
        session = driver.shared or driver.sessions.pop(outcome.lease_id)
        retire = [driver.watches.pop(w) for w in outcome.retire if w in driver.watches]
        log_acquired(self.name, self.max, outcome, driver.started)
        return Hold(self, session, outcome, retire, shared)

    async def _read_standing(
        self, action: messages.ReadStanding, interrupt: asyncio.Event
    ) -> messages.StandingAnswer:
        """Steps 2-3 (``codec.standing_reads``): the window, and our key with the one just
        ahead, seen at one revision, read by the plan for the endpoint's etcd release."""
        client = self.client.sync
        reads = codec.standing_reads(action, self.prefix, self.max)
        read = await read_together(client, reads, await read_plan(client, interrupt), interrupt)
        return codec.standing_answer(action, read)


async def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """``conch.who``, awaited: every key under ``name`` as a Record (the same listing: one
    KV.Range, then one per holder for its hold time). Raises as ``conch.who``."""
    steps = listing(name, max_holders)
    response: rpc_pb2.RangeResponse | None = None
    try:
        while True:
            request = steps.send(response)
            try:
                response = await etcd_aio.range_(client.sync, request)
            except errors.Compacted:
                response = None
    except StopIteration as done:
        records: list[Record] = done.value
        return records
