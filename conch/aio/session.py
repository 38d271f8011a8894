"""The asyncio face's Session: one lease and its keepalives, on the loop."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any

from conch import errors, log
from conch.aio.client import Client
from conch.aio.tasks import outlast_cancel, spawn
from conch.core.loss import CLOSED, Loss
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import lease
from conch.session import Keeper, check_ttl, claim, listen, log_granted, warn_session_dropped
from conch.timer import LoopTimer


class _Keeper(Keeper):
    """The asyncio face's ``conch.session.Keeper``, on the loop's timers."""

    def __init__(self, client: Client, lease_id: int, ttl: int, granted_at: float) -> None:
        self.loop = asyncio.get_running_loop()
        super().__init__(lease_id, ttl, granted_at, LoopTimer(self.loop))
        self.client = client
        self.lost = asyncio.Event()
        self.reason: Loss | None = None
        self.revoked: asyncio.Future[bool] | None = None
        self.listeners: dict[object, Callable[[Loss], None]] = {}
        self._ended = self.loop.create_future()
        self.task = self.loop.create_task(self._live())
        client._keepers.add(self)
        self.start()

    async def _live(self) -> None:
        """Parked until the session ends: closed, lost, or the loop ending (asyncio.run
        cancels what is left). Then the client's keepalive stream no longer counts this
        lease among those it serves."""
        try:
            await self._ended
        finally:
            if self.next_wake is not None:
                self.next_wake.cancel()
            etcd_aio.forget_lease(self.client.sync, self.lease_id)

    def _end(self) -> None:
        if not self._ended.done():
            self._ended.set_result(None)

    def send(self, deadline: float) -> None:
        spawn(self.loop, self._keepalive(deadline))

    async def _keepalive(self, deadline: float) -> None:
        sent = time.monotonic()
        outcome: lease.Outcome
        try:
            outcome = await etcd_aio.keepalive(self.client.sync, self.lease_id, deadline)
        except EtcdError as exc:
            outcome = exc
        self.settle(sent, outcome)

    def declare_lost(self, reason: Loss) -> None:
        self.reason = reason
        self.lost.set()
        self._end()
        for key in list(self.listeners):
            listener = self.listeners.pop(key, None)
            if listener is not None:
                run_callback(listener, reason)

    def tell(self, listener: Callable[[Loss], None], loss: Loss) -> None:
        run_callback(listener, loss)

    def add_listener(self, listener: Callable[[Loss], None]) -> Callable[[], None]:
        """Call ``listener(reason)`` on the loop once the session is lost (soon, if it is
        already); returns a function that removes it."""
        if self.lost.is_set():
            self.loop.call_soon(run_callback, listener, self.reason or CLOSED)
        return listen(self.listeners, listener)

    async def close(self, timeout: float | None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke) within ``timeout``
        seconds; whether confirmed. A second close waits for the first one's revoke."""
        if self.revoked is None:
            self.stop()
            self._end()
            etcd_aio.forget_lease(self.client.sync, self.lease_id)
            self.client._keepers.discard(self)
            self.revoked = self.loop.create_task(self._revoke(timeout))
        return await outlast_cancel(self.revoked)

    async def _revoke(self, timeout: float | None) -> bool:
        try:
            await etcd_aio.revoke(self.client.sync, self.lease_id, timeout)
        except EtcdError as exc:
            log.warning("revoke-failed", lease=f"{self.lease_id:x}", error=str(exc))
            return False
        return True


def run_callback(callback: Callable[[Loss], object], reason: Loss) -> None:
    try:
        callback(reason)
    except Exception as exc:  # one embedder's bug must not silence the others
        log.error("callback-failed", error=repr(exc))


def _session_dropped(keeper: _Keeper) -> None:
    """A Session was garbage-collected unclosed: warn, as Python does for an unclosed file,
    and revoke its lease on its loop (if the loop still runs; else it expires by its TTL)."""
    warn_session_dropped("conch.aio", keeper.lease_id)
    etcd_aio.call_soon(keeper.loop, lambda: spawn(keeper.loop, keeper.close(None)))


class Session:
    """One etcd lease of ``ttl`` seconds (Lease.LeaseGrant), refreshed every TTL/3 on the
    loop, on the client's one LeaseKeepAlive stream (shared with the threaded face's
    sessions); the coroutine face of ``conch.Session``. Open it with ``async with
    Session(client, ttl)`` or ``session = await Session(client, ttl)``; ``await
    session.close()`` revokes the lease, so every key on it goes at once.

    ``lost`` (an ``asyncio.Event``) is set when etcd says the lease is gone (a keepalive
    answered with TTL <= 0); ``reason`` is then a ``conch.core.loss.Loss`` (a str, with
    ``.reason`` LossReason.LEASE_NOT_FOUND). A keepalive left unanswered is sent again with
    backoff and loses nothing by itself: past ``alive_until`` unconfirmed the holds on the
    session are lost, the session (a waiter's place) lives on until etcd says otherwise,
    as ``conch.Session`` (the rule is ``conch.core.session``'s).
    ``alive_until`` is the ``time.monotonic()`` until which the lease is alive for sure (the
    last answered keepalive's send time + TTL). Raises UsageError for a bad ttl or client,
    Unavailable (or another EtcdError) when LeaseGrant fails.

    Share it between holds with ``sema.acquire(session=session)``: a hold on a shared
    session releases by deleting its own key, the session's loss loses every hold on it,
    and it holds at most one key per semaphore at a time (a second acquire of the same
    semaphore on it raises UsageError while the first waits or holds). A session dropped
    without ``close()`` is revoked when collected, with a ResourceWarning.
    """

    def __init__(self, client: Client, ttl: int = 10) -> None:
        if not isinstance(client, Client):
            raise errors.UsageError(
                f"bad client {client!r}: want a conch.aio.Client (conch.aio.connect(...))"
            )
        check_ttl(ttl)
        self.client = client
        self.ttl = ttl
        self._keeper: _Keeper | None = None
        self._claims: set[bytes] = set()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    async def _open(self, interrupt: asyncio.Event | None = None) -> Session:
        if self._keeper is not None:
            return self
        asked = time.monotonic()
        granted = await etcd_aio.grant(self.client.sync, self.ttl, interrupt=interrupt)
        # etcd restarts the countdown when it receives the grant, which is after we sent it:
        # so the lease is certainly alive until send time + TTL (monotonic).
        keeper = _Keeper(self.client, granted.id, granted.ttl, asked)
        self._keeper = keeper
        self._finalizer = weakref.finalize(self, _session_dropped, keeper)
        self._finalizer.atexit = False  # at exit the lease simply expires after its TTL
        log_granted(granted.id, self.ttl, granted.ttl)
        self.ttl = granted.ttl
        return self

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _kept(self) -> _Keeper:
        if self._keeper is None:
            raise errors.UsageError("session not open: await it or use async with")
        return self._keeper

    @property
    def lease_id(self) -> int:
        return self._kept.lease_id

    @property
    def interval(self) -> float:
        """Seconds between keepalives (TTL/3)."""
        return self._kept.interval

    @property
    def lost(self) -> asyncio.Event:
        return self._kept.lost

    @property
    def reason(self) -> Loss | None:
        """Why the session was lost (a Loss: its message, and its ``reason``, a
        LossReason); None while it is not."""
        return self._kept.reason

    @property
    def alive_until(self) -> float:
        """``time.monotonic()`` until which the lease is alive for sure."""
        return self._kept.alive_until

    def certainly_alive(self) -> bool:
        """Whether the lease is alive for sure now: not lost, not closed, and etcd's
        countdown from our last answered keepalive not run out."""
        return self._kept.certainly_alive()

    def _claim(self, key: bytes) -> None:
        claim(self._claims, key, self.lease_id)

    def _unclaim(self, key: bytes) -> None:
        self._claims.discard(key)

    async def close(self, timeout: float | None = None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke), waiting at most
        ``timeout`` seconds (default: the client's request timeout). Returns False when the
        revoke could not be confirmed (the lease then expires after its TTL). A cancel
        while it runs waits for the revoke to end, then propagates."""
        if self._keeper is None:
            return True
        if self._finalizer is not None:
            self._finalizer.detach()
        return await self._keeper.close(timeout)
