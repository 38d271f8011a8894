"""The queue recipe on each peer's API, for the benchmarks that set conch beside them.

Both are the recipe of etcd3aio's Lock (etcd3aio/concurrency.py): grant a lease, put
``prefix/<lease-id>`` on it, range the prefix by create_revision, watch the key ahead of ours
for its delete, and go first when no key is ahead; the lease kept alive while waiting, as a
waiter that keeps its place must (etcd3aio's Lock sends no keepalive of its own). Each is an
async context manager: entered, the caller holds the turn; left, the key is deleted and the
lease revoked (also when the wait is cancelled). ``keepalive=False`` leaves the lease
unrefreshed, for turns far shorter than the TTL (bench/cycles.py measures the peers so).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def aetcd_turn(
    client: Any, prefix: bytes, ttl: int, keepalive: bool = True
) -> AsyncIterator[bytes]:
    """The turn on aetcd's API, the lease kept alive every TTL/3 with ``lease.refresh()``;
    yields our key."""
    from aetcd.rtypes import EventKind  # type: ignore[import-untyped]

    async def keep_alive(lease: Any) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            await lease.refresh()

    lease = await client.lease(ttl)
    key = prefix + f"{lease.id:016x}".encode()
    refresher = asyncio.create_task(keep_alive(lease)) if keepalive else None
    try:
        await client.put(key, b"", lease=lease)
        while True:
            answer = await client.get_prefix(prefix, sort_order="ascend", sort_target="create")
            ranked = [kv.key for kv in answer.kvs]
            mine = ranked.index(key)
            if mine == 0:
                break
            await client.watch_once(
                ranked[mine - 1], start_revision=answer.header.revision + 1, kind=EventKind.DELETE
            )
        yield key
    finally:
        if refresher is not None:
            refresher.cancel()
        with contextlib.suppress(Exception):
            await client.delete(key)
        with contextlib.suppress(Exception):
            await lease.revoke()


@contextlib.asynccontextmanager
async def etcd3aio_turn(
    client: Any, prefix: bytes, ttl: int, keepalive: bool = True
) -> AsyncIterator[bytes]:
    """The turn on etcd3aio's API (a connected ``Etcd3Client``), the lease kept alive by
    its documented ``lease.keep_alive_context``; yields our key."""
    from etcd3aio import prefix_range_end

    kv, leases, watch = client.kv, client.lease, client.watch  # set by connect()
    lease = await leases.grant(ttl=ttl, timeout=10)
    key = prefix + f"{lease.ID:016x}".encode()
    try:
        kept = leases.keep_alive_context(lease.ID, ttl=ttl) if keepalive else None
        async with kept or contextlib.nullcontext():
            await kv.put(key, b"", lease=lease.ID, timeout=10)
            while True:
                answer = await kv.get(prefix, range_end=prefix_range_end(prefix), timeout=10)
                ranked = sorted(answer.kvs, key=lambda kv_: kv_.create_revision)
                mine = next(i for i, kv_ in enumerate(ranked) if kv_.key == key)
                if mine == 0:
                    break
                ahead = ranked[mine - 1].key
                async for response in watch.watch(ahead, start_revision=answer.header.revision + 1):
                    if any(e.type == 1 and e.kv.key == ahead for e in response.events):
                        break
            yield key
    finally:
        with contextlib.suppress(Exception):
            await kv.delete(key, timeout=10)
        with contextlib.suppress(Exception):
            await leases.revoke(lease.ID, timeout=10)
