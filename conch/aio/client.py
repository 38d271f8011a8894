"""The asyncio face's client (a conch.etcd Client for coroutines), and ``Entering``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from conch.etcd import client as etcd_client

if TYPE_CHECKING:
    from conch.aio.session import _Keeper

E = TypeVar("E", bound=contextlib.AbstractAsyncContextManager[Any])


class Client(contextlib.AbstractAsyncContextManager["Client"]):
    """An etcd client for coroutines. ``sync`` is the ``conch.etcd.Client`` under it: its
    endpoints, token and failover, and its grpc.aio channels and streams of each loop (its
    blocking calls must not run on the loop). ``await client.close()`` (or leaving ``async
    with``) revokes the leases of the coroutine sessions still open on it (at most
    CLOSE_REVOKE_TIMEOUT seconds in all), then closes the channels."""

    def __init__(self, sync: etcd_client.Client) -> None:
        self.sync = sync
        self._keepers: set[_Keeper] = set()

    async def close(self) -> None:
        keepers, self._keepers = list(self._keepers), set()
        timeout = etcd_client.CLOSE_REVOKE_TIMEOUT  # gather() of none is done at once
        await asyncio.gather(*(k.close(timeout) for k in keepers), return_exceptions=True)
        self.sync.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Entering(Generic[E]):
    """What ``enter()`` makes: ``await`` it for an E of your own to close, or ``async with``
    it for an E exited (``E.__aexit__``) when the block ends."""

    def __init__(self, enter: Callable[[], Awaitable[E]]) -> None:
        self._enter = enter

    def __await__(self) -> Generator[Any, Any, E]:
        return self._enter().__await__()

    async def __aenter__(self) -> E:
        self._made = await self._enter()
        return self._made

    async def __aexit__(self, *exc: Any) -> None:
        await self._made.__aexit__(*exc)


def connect(
    endpoints: str | Sequence[str],
    dial_timeout: float = 5.0,
    request_timeout: float = 5.0,
    tls: etcd_client.TLS | None = None,
    credentials: etcd_client.Credentials | None = None,
) -> Entering[Client]:
    """``async with connect(endpoints, ...) as client`` (or ``client = await connect(...)``):
    a Client dialled within ``dial_timeout`` seconds, closed when the block ends. Arguments
    and errors as ``conch.connect`` (UsageError, Unavailable, AuthenticationFailed); the
    dial (Maintenance.Status, or Auth.Authenticate with credentials) is awaited, and a
    cancel ends it at once."""

    async def dial() -> Client:
        sync = await etcd_client.Client.connect_async(
            etcd_client.parse_endpoints(endpoints), dial_timeout, request_timeout, tls, credentials
        )
        return Client(sync)

    return Entering(dial)
