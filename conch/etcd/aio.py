"""The etcd layer for coroutines: the same calls and streams as the threaded layer, awaited.

Unary calls are ``Client.call_async``: one gRPC ``.future()`` per attempt, under the
client's own deadlines, failover and token renewal. The streams are the client's own, shared
with the threaded face: its one Watch.Watch stream (``conch.etcd.watch``), whose reader
thread hands each notice to the loop with ``call_soon_threadsafe`` (``LoopWatch``), and its
one LeaseKeepAlive stream for the leases of all its sessions (``lease.KeepAlives``), whose
timer thread hands each answer to the loop the same way (``keepalive``). So a process pays a
constant number of threads for any number of waiters, holds and sessions: no thread per
call, none per waiter, and nothing on the loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd import kv, lease
from conch.etcd.client import Client
from conch.etcd.lease import Grant
from conch.etcd.watch import Watch, WatchNotice


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any) -> bool:
    """Schedule ``callback(*args)`` on ``loop`` from any thread; False when the loop is
    closed (asyncio.run is over, or the service stopped without waiting for us)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


# -- unary calls -----------------------------------------------------------------------------


async def range_(
    client: Client,
    request: rpc_pb2.RangeRequest,
    timeout: float | None = None,
    interrupt: asyncio.Event | None = None,
) -> rpc_pb2.RangeResponse:
    """KV.Range (``kv.range_``), awaited; ``interrupt`` as in ``Client.call_async``."""
    response: rpc_pb2.RangeResponse = await client.call_async(
        "kv", "Range", request, timeout, interrupt=interrupt
    )
    return response


async def txn(
    client: Client,
    compare: list[rpc_pb2.Compare],
    success: list[rpc_pb2.RequestOp],
    failure: list[rpc_pb2.RequestOp],
    timeout: float | None = None,
    interrupt: asyncio.Event | None = None,
) -> rpc_pb2.TxnResponse:
    """KV.Txn (``kv.txn``), awaited; ``interrupt`` as in ``Client.call_async``."""
    request = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
    response: rpc_pb2.TxnResponse = await client.call_async(
        "kv", "Txn", request, timeout, interrupt=interrupt
    )
    return response


async def delete_own_key(
    client: Client, key: bytes, revision: int, timeout: float | None = None
) -> bool:
    """``hold.delete_own_key``, awaited: delete ``key`` if its create_revision is still
    ``revision`` (one KV.Txn); whether it was ours to delete."""
    compare = [kv.create_revision_is(key, revision)]
    response = await txn(client, compare, [kv.op_delete(key)], [], timeout)
    return bool(response.succeeded)


async def grant(
    client: Client, ttl: int, timeout: float | None = None, interrupt: asyncio.Event | None = None
) -> Grant:
    """Lease.LeaseGrant (``lease.grant``), awaited; ``interrupt`` as in ``call_async``."""
    request = rpc_pb2.LeaseGrantRequest(TTL=ttl)
    response = await client.call_async("lease", "LeaseGrant", request, timeout, interrupt=interrupt)
    if response.error:
        raise EtcdError(f"lease grant refused: {response.error}")
    return Grant(response.ID, response.TTL)


async def revoke(client: Client, lease_id: int, timeout: float | None = None) -> None:
    """Lease.LeaseRevoke (``lease.revoke``), awaited; a lease already gone counts as revoked."""
    with contextlib.suppress(LeaseNotFound):
        request = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        await client.call_async("lease", "LeaseRevoke", request, timeout)


async def time_to_live(
    client: Client,
    lease_id: int,
    timeout: float | None = None,
    interrupt: asyncio.Event | None = None,
) -> int:
    """Lease.LeaseTimeToLive (``lease.time_to_live``), awaited: seconds left, -1 when gone;
    ``interrupt`` as in ``Client.call_async``."""
    request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
    response = await client.call_async(
        "lease", "LeaseTimeToLive", request, timeout, interrupt=interrupt
    )
    return int(response.TTL)


# -- the Watch stream ------------------------------------------------------------------------


class LoopWatch:
    """A ``Watch`` on the client's shared stream whose notices reach ``on_notice`` on the
    loop that opened it, in order (the stream's reader thread hands each one over with
    ``call_soon_threadsafe``). Arguments as ``Watch``; ``on_notice`` must not block. Once
    ``cancel()`` returns, ``on_notice`` is not called again, not even for a notice already
    handed to the loop. Open it with ``await LoopWatch.open(...)``: the stream's auth token
    is fetched first, without blocking the loop. Raises EtcdError as ``Watch``."""

    def __init__(
        self,
        client: Client,
        on_notice: Callable[[WatchNotice], None],
        key: bytes,
        start_revision: int = 0,
        range_end: bytes = b"",
        only_deletes: bool = False,
        confirm: bool = False,
    ) -> None:
        self._on_notice = on_notice
        self._cancelled = False
        loop = asyncio.get_running_loop()

        def deliver(notice: WatchNotice) -> None:  # the stream's reader thread
            call_soon(loop, self._deliver, notice)

        self.watch = Watch(client, key, start_revision, deliver, range_end, only_deletes, confirm)

    @classmethod
    async def open(
        cls,
        client: Client,
        on_notice: Callable[[WatchNotice], None],
        key: bytes,
        start_revision: int = 0,
        range_end: bytes = b"",
        only_deletes: bool = False,
        confirm: bool = False,
    ) -> LoopWatch:
        """A LoopWatch, once the stream's auth token is at hand: opening the stream (if it
        is not open) then makes no call that waits, since gRPC starts a stream without
        waiting for its answer."""
        await client.token_async()
        return cls(client, on_notice, key, start_revision, range_end, only_deletes, confirm)

    def _deliver(self, notice: WatchNotice) -> None:  # on the loop
        if not self._cancelled:
            self._on_notice(notice)

    def cancel(self) -> None:
        """Stop the watch (Watch.cancel: a WatchCancelRequest on the stream, no wait)."""
        self._cancelled = True
        self.watch.cancel()


# -- the LeaseKeepAlive stream ---------------------------------------------------------------


# Beyond a keepalive's own deadline, which the keepalives' timer thread enforces: how late
# that thread may be scheduled before the awaiting coroutine stops waiting for it.
KEEPALIVE_SLACK = 1.0  # seconds


async def keepalive(client: Client, lease_id: int, deadline: float) -> int:
    """One LeaseKeepAlive of ``lease_id`` on the client's one keepalive stream (shared with
    every session of the client, either face: ``lease.KeepAlives``), awaited: the lease's
    TTL in seconds. Raises LeaseNotFound when etcd answers TTL <= 0 (expired or revoked),
    Unavailable when no answer comes by ``deadline`` (``time.monotonic()``). A cancel of
    the awaiting task leaves the keepalive to run out on its own (its answer is dropped)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[lease.Outcome] = loop.create_future()

    def done(outcome: lease.Outcome) -> None:  # the keepalives' timer thread
        call_soon(loop, _settle, answer, outcome)

    lease.keepalives_for(client).refresh(lease_id, deadline, done)
    left = max(0.0, deadline - time.monotonic()) + KEEPALIVE_SLACK
    try:
        outcome = await asyncio.wait_for(answer, left)
    except TimeoutError:
        raise Unavailable("keepalive: no answer in time") from None
    if isinstance(outcome, EtcdError):
        raise outcome
    return outcome


def forget_lease(client: Client, lease_id: int) -> None:
    """Stop keeping ``lease_id`` alive on the client's keepalive stream (no wait)."""
    lease.keepalives_for(client).forget(lease_id)


def _settle(answer: asyncio.Future[lease.Outcome], outcome: lease.Outcome) -> None:
    if not answer.done():
        answer.set_result(outcome)
