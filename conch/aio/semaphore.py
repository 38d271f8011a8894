"""The asyncio face's Semaphore: the driver of the waiting recipe on the loop, and who()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from conch import errors
from conch import semaphore as recipe
from conch.aio.client import Client, Entering
from conch.aio.hold import Hold
from conch.aio.session import Session
from conch.core import codec, messages
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import status
from conch.etcd.loop import outlast_cancel, resolve
from conch.hold import WITHDRAW_TIMEOUT
from conch.identity import Identity
from conch.listing import Record, listing


class _Driver(recipe.Driver[etcd_aio.LoopWatch]):
    """Runs one ``waiter.Waiter`` from a coroutine: its steps awaited one after another,
    and what arrives on the loop (notices, a session's loss, an interrupt) on ``box``."""

    sema: Semaphore
    shared: Session | None

    def __init__(
        self, sema: Semaphore, timeout: float | None, session: Session | None, key: bytes | None
    ) -> None:
        super().__init__(sema, session, key, timeout)
        # What ``Next`` sleeps on, resolved by ``put``: with the SimpleQueue ``box``, all a
        # waiter needs (an asyncio.Queue, its Event and four deques, took 3 KiB a waiter).
        self.wake: asyncio.Future[None] | None = None
        self.client = sema.client.sync
        self.interrupted = asyncio.Event()
        self.sessions: dict[int, Session] = {}  # private sessions opened, by lease

    async def run(self) -> messages.Outcome:
        if self.shared is not None:
            self._subscribe(self.shared)
        try:
            return await drive(self.client, self.steps(), self.interrupted, self._act)
        finally:
            held = self.let_go()
            # The machine closes every private session it leaves; after a failure of our
            # own (a bug, the loop shutting down), none may be left kept alive.
            kept = None if held is None else held.lease_id
            left = [self.sessions.pop(lease) for lease in list(self.sessions) if lease != kept]
            await asyncio.gather(*(s.close(WITHDRAW_TIMEOUT) for s in left), return_exceptions=True)

    def hold(self, outcome: messages.Outcome) -> Hold:
        held, retire = self.held(outcome)
        session = self.shared or self.sessions.pop(held.lease_id)
        return Hold(self.sema, session, held, retire, self.shared is not None)

    def put(self, item: Any) -> None:
        super().put(item)
        if self.wake is not None:
            resolve(self.wake, None)

    def _subscribe(self, session: Session) -> None:
        self.forget.append(session._kept.add_listener(self.on_session(session.lease_id)))

    async def _act(self, action: Any) -> messages.Input | None:
        """The steps of this face's own: their answer (None: none, or later on the queue)."""
        sema, interrupted = self.sema, self.interrupted
        if isinstance(action, recipe.Next):  # what comes is on the box, for ``arrived``
            self.wake = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake, action.timeout)
            return None
        if isinstance(action, messages.OpenSession):
            session = await Session(sema.client, sema.ttl)._open(interrupted)
            self.sessions[session.lease_id] = session
            self._subscribe(session)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, messages.CheckLease):
            alive = self.shared is None or self.shared.certainly_alive()
            args = self.client, action.lease_id, WITHDRAW_TIMEOUT, interrupted
            ttl = await etcd_aio.time_to_live(*args) if alive else 0
            return messages.LeaseAnswer(action.id, ttl)
        if isinstance(action, messages.Withdraw):  # a private session's: revoked
            private = self.sessions.pop(action.lease_id, None)
            if private is not None:
                await private.close(WITHDRAW_TIMEOUT)
            return messages.Over(action.id)
        assert isinstance(action, messages.OpenWatch)
        key, end, deletes = codec.watch_range(action)
        tell = partial(self.tell, action.id)  # on the loop
        watch = etcd_aio.LoopWatch.open(self.client, tell, key, 0, end, deletes, confirm=True)
        self.watches[action.id] = await watch
        return None


async def drive(
    client: etcd_client.Client,
    steps: recipe.Steps[recipe.T],
    interrupt: asyncio.Event | None = None,
    act: Callable[[Any], Awaitable[Any]] | None = None,
) -> recipe.T:
    """``conch.semaphore.drive``, awaited: a call by ``Client.call_async``, PLAN with one
    Status per endpoint and loop at most."""
    run = recipe.Run(steps)
    for step in run:
        try:
            if step is recipe.PLAN:
                run.reply = codec.read_plan(await status.server_version_async(client, interrupt))
            elif isinstance(step, codec.Call):
                args = "kv", step.method, step.request, step.timeout
                cut = interrupt if step.timeout is None else None  # as ``conch.semaphore.drive``
                run.reply = await client.call_async(*args, interrupt=cut)
            else:
                assert act is not None
                run.reply = await act(step)
        except (errors.EtcdError, errors.Interrupted) as exc:
            run.error = exc
    return run.answer


async def _release_if_granted(
    driver: _Driver, driving: asyncio.Task[messages.Outcome], unclaim: Callable[[], None]
) -> None:
    try:
        hold = driver.hold(await driving)
    except errors.ConchError:  # Interrupted, NoSlot...: no key left
        unclaim()
        return
    await hold.release()


class Semaphore(recipe.Recipe):
    """The semaphore (``name``, ``max``) on ``client``, for coroutines: arguments and
    UsageError as ``conch.Semaphore`` (checked here, no etcd call)."""

    client: Client
    _face = (Client, "conch.aio")

    def __init__(
        self,
        client: Client,
        name: str,
        max: int,
        ttl: int = 10,
        spread: bool = False,
        identity: Identity | None = None,
    ) -> None:
        super().__init__(client, name, max, ttl, spread, identity or Identity.current())

    def acquire(
        self, timeout: float | None = None, session: Session | None = None
    ) -> Entering[Hold]:
        """``async with sema.acquire(timeout) as hold`` (or ``hold = await ...``): wait for a
        slot (``conch.Semaphore.acquire``, the same recipe). ``timeout`` in seconds: None
        waits as long as it takes, 0 tries once. Raises NoSlot when time runs out,
        Unavailable when no session can be established, UsageError for a bad timeout.
        ``session``: a ``conch.aio.Session`` of this client to hold the slot on (a loss
        while queued raises SessionLost). Cancelling the waiting task withdraws our key (or
        releases a slot granted meanwhile) before the CancelledError leaves it."""
        return Entering(lambda: self._acquire(timeout, session))

    async def _acquire(self, timeout: float | None, session: Session | None) -> Hold:
        key, unclaim = self._claim(session, timeout)
        driver = _Driver(self, timeout, session, key)
        loop = asyncio.get_running_loop()
        driving = loop.create_task(driver.run())
        try:
            return driver.hold(await asyncio.shield(driving))
        except asyncio.CancelledError:
            # Withdraw our key before the cancel propagates (the set event ends the retries of
            # a call under way); a slot granted just now is released, run as a task of its
            # own: a second cancel does not cut that short.
            driver.interrupted.set()
            driver.put(messages.Interrupt("cancelled"))
            await outlast_cancel(loop.create_task(_release_if_granted(driver, driving, unclaim)))
            raise
        except BaseException:
            unclaim()
            raise


async def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """``conch.who``, awaited: every key under ``name`` as a Record (the same listing: one
    KV.Range, then one per holder for its hold time). Raises as ``conch.who``."""
    return await drive(client.sync, listing(name, max_holders))
