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
from conch.aio.hold import Hold, touch
from conch.aio.session import Session
from conch.aio.tasks import T, outlast_cancel, spawn  # noqa: F401
from conch.core import messages, waiter
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import kv
from conch.etcd.client import Backoff, check_timeout
from conch.etcd.watch import WatchNotice
from conch.hold import WITHDRAW_TIMEOUT
from conch.identity import Identity
from conch.listing import Record, listing

# The threaded driver's readings of etcd's answers, shared so that the faces cannot differ.
from conch.semaphore import (
    _EVENT_TYPES,
    REENTRY_BACKOFF_CAP,
    _enqueue_answer,
    _failure,
    _key_rev,
    log_acquired,
    log_note,
    revision_to_count,
)
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
            return messages.Failed(action.id, _failure(exc), str(exc), exc)

    async def _call(self, action: messages.Action) -> messages.Input:
        sema, client = self.sema, self.client
        if isinstance(action, messages.OpenSession):
            session = await Session(sema.client, sema.ttl)._open(self.interrupted)
            self.sessions[session.lease_id] = session
            self.current_lease = session.lease_id
            self._subscribe(session)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, messages.SendEnqueue):
            value, response = await sema._enqueue(action, self.interrupted)
            return _enqueue_answer(action, response, value)
        if isinstance(action, messages.ReadStanding):
            return await sema._read_standing(action, self.interrupted)
        if isinstance(action, messages.ReadKeys):
            reads = [kv.op_get(key) for key in action.keys]
            response = await etcd_aio.txn(client, [], reads, [], interrupt=self.interrupted)
            found = [r.response_range.kvs for r in response.responses]
            kvs = [_key_rev(k[0]) if k else None for k in found]
            return messages.KeysAnswer(action.id, int(response.header.revision), kvs)
        if isinstance(action, messages.Touch):
            touched = await touch(
                client, action.key, action.revision, action.value, action.lease_id, self.interrupted
            )
            return messages.TouchAnswer(
                action.id, int(touched.header.revision), bool(touched.succeeded)
            )
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

    async def _open_watch(self, action: messages.OpenWatch) -> messages.Input | None:
        watch_id = action.id
        put = self.inputs.put_nowait

        def on_notice(notice: WatchNotice) -> None:  # on the loop
            put(_watch_input(watch_id, notice))

        end = kv.prefix_end(action.key) if action.prefix else b""
        try:
            watch = await etcd_aio.LoopWatch.open(
                self.client, on_notice, action.key, 0, end, only_deletes=action.prefix, confirm=True
            )
        except EtcdError as exc:
            return messages.Failed(watch_id, _failure(exc), str(exc), exc)
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
            if action.revision:
                await etcd_aio.delete_own_key(
                    self.client, action.key, action.revision, WITHDRAW_TIMEOUT
                )
                return
            on_our_lease = rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.LEASE,
                key=action.key,
                lease=action.lease_id,
            )
            await etcd_aio.txn(
                self.client, [on_our_lease], [kv.op_delete(action.key)], [], WITHDRAW_TIMEOUT
            )
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
        request = kv.prefix_request(
            self.sema.prefix, keys_only=True, max_create_revision=revision - 1
        )
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


def _watch_input(watch_id: int, notice: WatchNotice) -> messages.Input:
    """A notice of watch ``watch_id`` as the machine's input."""
    if notice.error is not None:
        compacted = isinstance(notice.error, errors.Compacted)
        return messages.WatchBroken(watch_id, compacted, str(notice.error))
    if notice.created:
        return messages.WatchCreated(watch_id, notice.revision)
    events = [messages.Event(_EVENT_TYPES[e.type], _key_rev(e.kv)) for e in notice.events]
    return messages.WatchEvents(watch_id, events, notice.revision)


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

    async def _enqueue(
        self, action: messages.SendEnqueue, interrupt: asyncio.Event
    ) -> tuple[bytes, kv.TxnResponse]:
        """Step 1: put our key bound to the lease, create-if-absent, and read the first
        ``max`` keys in the same KV.Txn (else read the key found in our place), as
        ``conch.Semaphore`` does. Returns the value we sent and the response."""
        value = self.identity.entering().to_json()
        key = action.key
        heads = kv.prefix_request(
            self.prefix, limit=self.max, keys_only=True, sort_target=kv.CREATE, sort_order=kv.ASCEND
        )
        response = await etcd_aio.txn(
            self.client.sync,
            [kv.create_revision_is(key, 0)],
            [kv.op_put(key, value, action.lease_id), kv.op_range(heads)],
            [kv.op_get(key)],
            interrupt=interrupt,
        )
        return value, response

    async def _read_standing(
        self, action: messages.ReadStanding, interrupt: asyncio.Event
    ) -> messages.StandingAnswer:
        """Steps 2-3: one read-only KV.Txn of two Ranges (keys only, up to our key's
        create_revision): the window ascending, our key and the one ahead descending."""
        common: dict[str, Any] = {
            "keys_only": True,
            "max_create_revision": action.revision,
            "sort_target": kv.CREATE,
        }
        window = kv.prefix_request(
            self.prefix, limit=waiter.window_size(self.max), sort_order=kv.ASCEND, **common
        )
        mine_and_prev = kv.prefix_request(self.prefix, limit=2, sort_order=kv.DESCEND, **common)
        reads = [kv.op_range(window), kv.op_range(mine_and_prev)]
        response = await etcd_aio.txn(self.client.sync, [], reads, [], interrupt=interrupt)
        first, last = (r.response_range.kvs for r in response.responses)
        return messages.StandingAnswer(
            action.id,
            int(response.header.revision),
            [_key_rev(k) for k in first],
            [_key_rev(k) for k in last],
        )


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
