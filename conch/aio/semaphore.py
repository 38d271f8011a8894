"""The asyncio face's Semaphore: the driver of the waiting recipe on the loop, and who()."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch import errors, keys
from conch import semaphore as recipe
from conch.aio.client import Client
from conch.aio.hold import Hold
from conch.aio.session import Session
from conch.aio.tasks import outlast_cancel
from conch.core import codec, messages
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import status
from conch.hold import WITHDRAW_TIMEOUT
from conch.identity import Identity
from conch.listing import Record, listing
from conch.session import check_ttl


class _Lost(NamedTuple):
    """A session's loss, as queued: fed to the machine only if it is the current session."""

    lease_id: int
    reason: str


class _Driver(recipe.Driver[etcd_aio.LoopWatch]):
    """Runs one ``waiter.Waiter`` from a coroutine: its steps awaited one after another,
    and what arrives on the loop (notices, a session's loss, an interrupt) through one
    queue, fed in before the next request (so no event waits behind a slow call)."""

    sema: Semaphore

    def __init__(self, sema: Semaphore, timeout: float | None, session: Session | None) -> None:
        super().__init__(sema, None if session is None else session.lease_id, timeout)
        self.client = sema.client.sync
        self.inputs: asyncio.Queue[messages.Input | _Lost] = asyncio.Queue()
        self.interrupted = asyncio.Event()
        self.shared = session
        self.sessions: dict[int, Session] = {}  # private sessions opened, by lease
        self.current_lease = 0 if session is None else session.lease_id
        self.forget: list[Callable[[], None]] = []

    def interrupt(self) -> None:
        """From the awaiting coroutine's cancel: stop waiting (the machine withdraws)."""
        self.interrupted.set()  # ends the retries of a call under way
        self.inputs.put_nowait(messages.Interrupt("cancelled"))

    async def run(self) -> messages.Outcome:
        if self.shared is not None:
            self._subscribe(self.shared)
        try:
            return await drive(self.client, self.steps(), self.interrupted, self._act)
        finally:
            for forget in self.forget:
                forget()
            outcome = self.machine.outcome
            held = outcome if isinstance(outcome, messages.Held) else None
            for watch_id in [w for w in self.watches if held is None or w not in held.retire]:
                self.cancel(watch_id)
            # The machine closes every private session it leaves; after a failure of our
            # own (a bug, the loop shutting down), none may be left kept alive.
            left = [
                s for s in self.sessions.values() if held is None or s.lease_id != held.lease_id
            ]
            for session in left:
                del self.sessions[session.lease_id]
            await asyncio.gather(*(s.close(WITHDRAW_TIMEOUT) for s in left), return_exceptions=True)

    def hold(self, outcome: messages.Outcome) -> Hold:
        held, retire = self.held(outcome)
        session = self.shared or self.sessions.pop(held.lease_id)
        return Hold(self.sema, session, held, retire, self.shared is not None)

    def arrived(self) -> messages.Input | None:
        while not self.inputs.empty():
            answer = self._input(self.inputs.get_nowait())
            if answer is not None:
                return answer
        return None

    def _input(self, item: messages.Input | _Lost) -> messages.Input | None:
        if not isinstance(item, _Lost):
            return item
        if item.lease_id != self.current_lease:
            return None  # a session we left
        return messages.SessionLost(item.reason)

    def _subscribe(self, session: Session) -> None:
        lease_id, put = session.lease_id, self.inputs.put_nowait
        self.forget.append(session._kept.add_listener(lambda reason: put(_Lost(lease_id, reason))))

    async def _act(self, action: Any) -> messages.Input | None:
        """The steps of this face's own: their answer (None: none, or later on the queue)."""
        sema, interrupted = self.sema, self.interrupted
        if isinstance(action, recipe.Next):
            try:
                return self._input(await asyncio.wait_for(self.inputs.get(), action.timeout))
            except TimeoutError:
                return None
        if isinstance(action, messages.SendEnqueue):
            value, response = await drive(self.client, recipe.enqueue(sema, action), interrupted)
            return codec.enqueue_answer(action, response, value)
        if isinstance(action, messages.ReadStanding):
            return await sema._read_standing(action, interrupted)
        if isinstance(action, messages.OpenSession):
            session = await Session(sema.client, sema.ttl)._open(interrupted)
            self.sessions[session.lease_id] = session
            self.current_lease = session.lease_id
            self._subscribe(session)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, messages.CheckLease):
            if self.shared is not None and not self.shared.certainly_alive():
                return messages.LeaseAnswer(action.id, 0)
            ttl = await etcd_aio.time_to_live(
                self.client, action.lease_id, WITHDRAW_TIMEOUT, interrupted
            )
            return messages.LeaseAnswer(action.id, ttl)
        if isinstance(action, messages.Withdraw):  # a private session's: revoked
            private = self.sessions.pop(action.lease_id, None)
            if private is not None:
                await private.close(WITHDRAW_TIMEOUT)
            return messages.Over(action.id)
        assert isinstance(action, messages.OpenWatch)
        put, watch_id = self.inputs.put_nowait, action.id
        key, end, only_deletes = codec.watch_range(action)
        self.watches[watch_id] = await etcd_aio.LoopWatch.open(
            self.client,
            lambda notice: put(codec.watch_input(watch_id, notice)),  # on the loop
            key,
            0,
            end,
            only_deletes=only_deletes,
            confirm=True,
        )
        return None


async def drive(
    client: etcd_client.Client,
    steps: recipe.Steps[recipe.T],
    interrupt: asyncio.Event | None = None,
    act: Callable[[Any], Awaitable[Any]] | None = None,
) -> recipe.T:
    """``conch.semaphore.drive``, awaited: a call by ``Client.call_async``, PLAN with one
    Status per endpoint and loop at most."""
    run = recipe.Exchange(steps)
    while not run.done:
        step = run.step
        try:
            if step is recipe.PLAN:
                reply = codec.read_plan(await status.server_version_async(client, interrupt))
            elif isinstance(step, recipe.Bounded):
                call = step.call
                reply = await client.call_async(
                    call.service, call.method, call.request, step.timeout
                )
            elif isinstance(step, codec.Call):
                service, method, request = step.service, step.method, step.request
                reply = await client.call_async(service, method, request, interrupt=interrupt)
            else:
                assert act is not None
                reply = await act(step)
        except (EtcdError, errors.Interrupted) as exc:
            run.fail(exc)
        else:
            run.reply(reply)
    return run.answer


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
        key = sema._claim(session, self._timeout)
        driver = _Driver(sema, self._timeout, session)
        loop = asyncio.get_running_loop()
        driving = loop.create_task(driver.run())
        try:
            return driver.hold(await asyncio.shield(driving))
        except asyncio.CancelledError:
            # Withdraw our key before the cancel propagates; a slot granted just now is
            # released. A second cancel does not cut that short.
            driver.interrupt()
            await outlast_cancel(loop.create_task(_release_if_granted(driver, driving)))
            raise
        except BaseException:
            if session is not None and key is not None:
                session._unclaim(key)
            raise

    def __await__(self) -> Generator[Any, None, Hold]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Hold:
        self._hold = await self._acquire()
        return self._hold

    async def __aexit__(self, *exc: Any) -> None:
        assert self._hold is not None
        await self._hold.__aexit__(*exc)


async def _release_if_granted(driver: _Driver, driving: asyncio.Task[messages.Outcome]) -> None:
    """After an interrupted wait: release the hold if it came all the same. Run as a task of
    its own, so a second cancel cannot stop it between the grant and the release."""
    try:
        hold = driver.hold(await driving)
    except errors.ConchError:  # Interrupted, NoSlot...: no key left
        if driver.shared is not None:
            driver.shared._unclaim(driver.sema._key(driver.shared.lease_id))
        return
    await hold.release()


class Semaphore(recipe.Recipe):
    """The semaphore (``name``, ``max``) on ``client``, for coroutines: arguments and
    UsageError as ``conch.Semaphore`` (checked here, no etcd call)."""

    client: Client

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

    async def _read_standing(
        self, action: messages.ReadStanding, interrupt: asyncio.Event
    ) -> messages.StandingAnswer:
        """Steps 2-3: the window, and our key with the one just ahead, at one revision."""
        reads = codec.standing_reads(action, self.prefix, self.max)
        return codec.standing_answer(
            action, await drive(self.client.sync, recipe.together(reads), interrupt)
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
