"""The asyncio face's Session: one lease and its keepalives, on the loop."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Generator
from typing import Any

from conch import log
from conch.aio.client import Client
from conch.core.loss import CLOSED, Loss
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd.loop import outlast_cancel, spawn
from conch.session import Keeper, SessionBase
from conch.timer import listen


class _Keeper(Keeper):
    def __init__(self, client: Client, lease_id: int, ttl: int, granted_at: float) -> None:
        self.loop = asyncio.get_running_loop()
        super().__init__(lease_id, ttl, granted_at, self.loop)
        self.client = client
        self.lost = asyncio.Event()
        self.reason: Loss | None = None
        self.revoked: asyncio.Future[bool] | None = None
        self.listeners: dict[object, Callable[[Loss], None]] = {}
        self.task = self.loop.create_task(self._live())
        client._keepers.add(self)

    async def _live(self) -> None:
        # Parked until cancelled (closed, lost, or asyncio.run ending): then forget the lease.
        try:
            await self.loop.create_future()
        finally:
            etcd_aio.forget_lease(self.client.sync, self.lease_id)  # the keepalive settles
            self.next_wake.cancel()  # and what it scheduled goes

    def send(self, deadline: float) -> None:
        settle = functools.partial(self.settle, time.monotonic())
        etcd_aio.keepalive(self.client.sync, self.lease_id, deadline, settle)

    def declare_lost(self, reason: Loss) -> None:
        self.reason = reason
        self.lost.set()
        self.task.cancel()
        while self.listeners:  # each once, in order; one may remove another
            log.call_back(self.listeners.pop(next(iter(self.listeners))), reason)

    tell = staticmethod(log.call_back)

    def dropped(self) -> None:
        """On its loop, if the loop still runs (else the lease expires by its TTL)."""
        etcd_aio.call_soon(self.loop, lambda: spawn(self.loop, self.close(None)))

    def add_listener(self, listener: Callable[[Loss], None]) -> Callable[[], None]:
        """``listener(reason)`` on the loop once lost (soon, if already); returns its remover."""
        if not self.lost.is_set():
            return listen(self.listeners, listener)
        self.loop.call_soon(log.call_back, listener, self.reason or CLOSED)
        return lambda: None

    async def close(self, timeout: float | None) -> bool:
        # Whether the revoke was confirmed; a second close waits for the first one's.
        if self.revoked is None:
            self.stop()
            self.task.cancel()
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


class Session(SessionBase[_Keeper]):
    """The coroutine face of ``conch.Session``: one etcd lease of ``ttl`` seconds
    (Lease.LeaseGrant), refreshed every TTL/3 on the loop. ``async with Session(client,
    ttl)`` or ``session = await Session(client, ttl)``; ``await session.close()`` revokes it.
    Raises UsageError for a bad ttl or client, Unavailable (or another EtcdError) when
    LeaseGrant fails. ``lost`` (an ``asyncio.Event``) is set, and ``reason`` is a Loss
    (LossReason.LEASE_NOT_FOUND), when etcd says the lease is gone; all else (the loss rule,
    ``alive_until``, sharing, a dropped session) is as ``conch.Session``'s."""

    def __init__(self, client: Client, ttl: int = 10) -> None:
        super().__init__(client, ttl, Client, "conch.aio")
        self.client = client

    async def _open(self, interrupt: asyncio.Event | None = None) -> Session:
        if self._keeper is None:
            asked = time.monotonic()
            granted = await etcd_aio.grant(self.client.sync, self.ttl, interrupt=interrupt)
            self._keep(_Keeper(self.client, granted.id, granted.ttl, asked))
        return self

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def lost(self) -> asyncio.Event:
        return self._kept.lost

    @property
    def reason(self) -> Loss | None:
        """Why the session was lost (a Loss, its ``reason`` a LossReason); None while not."""
        return self._kept.reason

    async def close(self, timeout: float | None = None) -> bool:
        """As ``conch.Session.close`` (Lease.LeaseRevoke within ``timeout`` seconds; False if
        not confirmed); a cancel while it runs waits for the revoke to end, then propagates."""
        return True if self._keeper is None else await self._closing().close(timeout)
