"""The etcd layer for coroutines: the same calls and streams as the threaded layer, awaited.

Unary calls are ``Client.call_async``: one gRPC ``.future()`` per attempt, under the
client's own deadlines, failover and token renewal. The streams are the client's own: its
one Watch.Watch stream (``conch.etcd.watch``), whose reader thread hands each notice to the
loop with ``call_soon_threadsafe`` (``LoopWatch``), and one LeaseKeepAlive stream for the
leases of every coroutine session on the client (``KeepAlives``). So a process pays a
constant number of threads for any number of waiters, holds and sessions: no thread per
call, none per waiter, and nothing on the loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd import kv
from conch.etcd.client import Backoff, BidiStream, Client, StreamItem
from conch.etcd.lease import ASK_ANOTHER_AFTER, Grant
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
    client: Client, request: rpc_pb2.RangeRequest, timeout: float | None = None
) -> rpc_pb2.RangeResponse:
    """KV.Range (``kv.range_``), awaited."""
    response: rpc_pb2.RangeResponse = await client.call_async("kv", "Range", request, timeout)
    return response


async def txn(
    client: Client,
    compare: list[rpc_pb2.Compare],
    success: list[rpc_pb2.RequestOp],
    failure: list[rpc_pb2.RequestOp],
    timeout: float | None = None,
) -> rpc_pb2.TxnResponse:
    """KV.Txn (``kv.txn``), awaited."""
    request = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
    response: rpc_pb2.TxnResponse = await client.call_async("kv", "Txn", request, timeout)
    return response


async def delete_own_key(
    client: Client, key: bytes, revision: int, timeout: float | None = None
) -> bool:
    """``hold.delete_own_key``, awaited: delete ``key`` if its create_revision is still
    ``revision`` (one KV.Txn); whether it was ours to delete."""
    compare = [kv.create_revision_is(key, revision)]
    response = await txn(client, compare, [kv.op_delete(key)], [], timeout)
    return bool(response.succeeded)


async def grant(client: Client, ttl: int, timeout: float | None = None) -> Grant:
    """Lease.LeaseGrant (``lease.grant``), awaited."""
    request = rpc_pb2.LeaseGrantRequest(TTL=ttl)
    response = await client.call_async("lease", "LeaseGrant", request, timeout)
    if response.error:
        raise EtcdError(f"lease grant refused: {response.error}")
    return Grant(response.ID, response.TTL)


async def revoke(client: Client, lease_id: int, timeout: float | None = None) -> None:
    """Lease.LeaseRevoke (``lease.revoke``), awaited; a lease already gone counts as revoked."""
    with contextlib.suppress(LeaseNotFound):
        request = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        await client.call_async("lease", "LeaseRevoke", request, timeout)


async def time_to_live(client: Client, lease_id: int, timeout: float | None = None) -> int:
    """Lease.LeaseTimeToLive (``lease.time_to_live``), awaited: seconds left, -1 when gone."""
    request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
    response = await client.call_async("lease", "LeaseTimeToLive", request, timeout)
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


class KeepAlives:
    """One LeaseKeepAlive stream per client for the leases of its coroutine sessions (etcd
    takes any number of lease IDs on one stream and answers each request with that ID), and
    its one reader thread. ``keepalives_for(client)`` gives the client's.

    ``await refresh(lease_id, deadline)`` sends one keepalive and returns the TTL etcd
    answered. The stream is opened when first needed; when it breaks, or stays silent
    ASK_ANOTHER_AFTER seconds with other endpoints to ask, calls fail over from its member
    and every refresh in flight is sent again on a new stream, until its deadline."""

    def __init__(self, client: Client) -> None:
        self._client_ref = weakref.ref(client)  # kept in a map keyed by the client
        self._lock = threading.Lock()  # the reader thread and the loops share the maps
        self._stream: BidiStream | None = None
        # The refreshes waiting for an answer on the current stream: etcd answers a lease's
        # keepalives in order, so each answer for an ID settles the oldest refresh of it.
        self._waiting: dict[int, list[_Pending]] = {}

    async def refresh(self, lease_id: int, deadline: float) -> int:
        """Return the lease's TTL (seconds) after one keepalive. Raises LeaseNotFound when
        etcd answers TTL <= 0 (expired or revoked), Unavailable when no answer comes by
        ``deadline`` (``time.monotonic()``)."""
        client = self._client()
        backoff = Backoff()
        last_error: EtcdError = Unavailable("keepalive: no answer in time")
        many = len(client.endpoints) > 1
        while time.monotonic() < deadline:
            try:
                await client.token_async(max(0.001, deadline - time.monotonic()))
                pending, stream = self._send(client, lease_id)
            except EtcdError as exc:
                last_error = exc
                await asyncio.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
                continue
            wait = deadline - time.monotonic()
            if many:
                wait = min(wait, ASK_ANOTHER_AFTER)
            try:
                answer = await asyncio.wait_for(asyncio.shield(pending.future), max(0.0, wait))
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on
                self._forget(lease_id, pending)
                if many and time.monotonic() < deadline:
                    # A silent member: calls and streams move on; ask the next one.
                    self._abandon(stream, Unavailable(f"keepalive: {stream.endpoint} silent"))
                continue
            except EtcdError as exc:
                last_error = exc
                await asyncio.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
                continue
            if answer <= 0:
                raise LeaseNotFound(f"lease {lease_id:x} expired or was revoked")
            return answer
        raise Unavailable(f"keepalive: no answer in time ({last_error})")

    def _client(self) -> Client:
        client = self._client_ref()
        if client is None:
            raise Unavailable("keepalive: client is gone")
        return client

    def _send(self, client: Client, lease_id: int) -> tuple[_Pending, BidiStream]:
        pending = _Pending(asyncio.get_running_loop())
        with self._lock:
            stream = self._stream
            if stream is None:
                if not client.token_at_hand():
                    # Renewed since refresh fetched it: fetch it again, not under the lock.
                    raise Unavailable("keepalive: auth token being renewed")
                stream = self._stream = BidiStream(client, "lease", "LeaseKeepAlive", self._on_item)
            self._waiting.setdefault(lease_id, []).append(pending)
            stream.send(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
        return pending, stream

    def _forget(self, lease_id: int, pending: _Pending) -> None:
        with self._lock:
            waiting = self._waiting.get(lease_id, [])
            if pending in waiting:
                # Its answer may still come: it must not settle a later refresh. Kept in
                # place, settled by nobody (a later answer pops it first).
                pending.abandoned = True

    def _on_item(self, item: StreamItem) -> None:
        """From the stream's reader thread: an answer settles the oldest refresh of its
        lease; the stream's end fails every refresh on it."""
        with self._lock:
            if item.stream is not self._stream:
                return
            if item.error is None:
                waiting = self._waiting.get(item.response.ID, [])
                pending = waiting.pop(0) if waiting else None
                if not waiting:
                    self._waiting.pop(item.response.ID, None)
                if pending is not None:
                    pending.settle(int(item.response.TTL), None)
                return
        self._abandon(item.stream, item.error)

    def _abandon(self, stream: BidiStream, error: EtcdError) -> None:
        """Leave ``stream`` (broken or silent): its member loses the calls too, and every
        refresh waiting on it fails with ``error`` (each is sent again on the next)."""
        with self._lock:
            if stream is not self._stream:
                return
            self._stream = None
            waiting, self._waiting = self._waiting, {}
        stream.close()
        client = self._client_ref()
        if client is not None:
            client.failover(stream.endpoint)
        for refreshes in waiting.values():
            for pending in refreshes:
                pending.settle(0, error)

    def close(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
            waiting, self._waiting = self._waiting, {}
        if stream is not None:
            stream.close()
        for refreshes in waiting.values():
            for pending in refreshes:
                pending.settle(0, Unavailable("keepalive stream closed"))


class _Pending:
    """One keepalive sent, its answer to come: a future on the loop that sent it."""

    __slots__ = ("abandoned", "future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[int] = loop.create_future()
        self.abandoned = False

    def settle(self, ttl: int, error: EtcdError | None) -> None:  # any thread
        if not self.abandoned:
            call_soon(self.loop, self._settle, ttl, error)

    def _settle(self, ttl: int, error: EtcdError | None) -> None:  # on the loop
        if self.future.done():
            return
        if error is None:
            self.future.set_result(ttl)
        else:
            self.future.set_exception(error)


_keepalives: weakref.WeakKeyDictionary[Client, KeepAlives] = weakref.WeakKeyDictionary()
_keepalives_lock = threading.Lock()


def keepalives_for(client: Client) -> KeepAlives:
    """The one KeepAlives of ``client``, made on first use, gone with the client."""
    with _keepalives_lock:
        keepalives = _keepalives.get(client)
        if keepalives is None:
            keepalives = _keepalives[client] = KeepAlives(client)
            client.on_close(lambda _seconds: keepalives.close())
        return keepalives
