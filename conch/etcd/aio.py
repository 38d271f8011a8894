"""The etcd layer for coroutines: the threaded layer's calls awaited (``Client.call_async``),
and one Watch.Watch stream (``LoopWatch``) and one LeaseKeepAlive stream (``keepalive``) per
client and loop, read by the loop with the threaded layer's decisions: no thread of ours
hands a message over, nothing uses the loop's default executor. In a process forked while
grpc.aio channels were open (``endpoints.loop_native``) they are the threaded client's
streams, whose threads hand each notice and answer to the loop (``call_soon_threadsafe``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar, cast

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import LeaseNotFound, Unavailable
from conch.etcd import lease
from conch.etcd.client import Client
from conch.etcd.endpoints import loop_native
from conch.etcd.loop import call_soon as call_soon
from conch.etcd.loop import resolve
from conch.etcd.watch import LoopHub, Watch, WatchNotice, _hub_for
from conch.timer import PerOwner

T = TypeVar("T")
P = ParamSpec("P")


async def range_(client: Client, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
    """KV.Range (``kv.range_``), awaited."""
    return cast(rpc_pb2.RangeResponse, await client.call_async("kv", "Range", request))


async def txn(
    client: Client,
    compare: list[rpc_pb2.Compare],
    success: list[rpc_pb2.RequestOp],
    failure: list[rpc_pb2.RequestOp],
    timeout: float | None = None,
) -> rpc_pb2.TxnResponse:
    """KV.Txn (``kv.txn``), awaited."""
    request = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
    return cast(rpc_pb2.TxnResponse, await client.call_async("kv", "Txn", request, timeout))


async def grant(client: Client, ttl: int, interrupt: asyncio.Event | None = None) -> lease.Grant:
    """Lease.LeaseGrant (``lease.grant``), awaited; ``interrupt`` as in ``call_async``."""
    request = rpc_pb2.LeaseGrantRequest(TTL=ttl)
    response = await client.call_async("lease", "LeaseGrant", request, interrupt=interrupt)
    return lease.granted(response)


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
    call = client.call_async("lease", "LeaseTimeToLive", request, timeout, interrupt=interrupt)
    return int((await call).TTL)


def _per_loop(
    make: Callable[[Client, asyncio.AbstractEventLoop], T], forked: Callable[[Client], T]
) -> Callable[[Client], T]:
    """``make(client, loop)`` once per client and running loop, made on first use (those of
    ended loops, and their streams, dropped then); in a forked process, ``forked(client)``."""
    tables: PerOwner[Client, dict[asyncio.AbstractEventLoop, T]] = PerOwner(lambda _c: {})

    def get(client: Client) -> T:
        if not loop_native():
            return forked(client)
        loop = asyncio.get_running_loop()
        table = tables(client)
        made = table.get(loop)
        if made is None:
            for ended in [other for other in table if other.is_closed()]:
                del table[ended]
            made = table[loop] = make(client, loop)
        return made

    return get


_hub = _per_loop(LoopHub, _hub_for)
_keepalives = _per_loop(lease.LoopKeepAlives, lease.keepalives_for)


class LoopWatch(Watch):
    """A ``Watch`` on the client's Watch stream of the running loop, whose notices reach
    ``on_notice`` on that loop, in order. Arguments as ``Watch``; ``on_notice`` must not
    block. Once ``cancel()`` (a WatchCancelRequest, no wait) returns, ``on_notice`` is not
    called again. Open it with ``await LoopWatch.open(...)``: the stream's auth token is
    fetched first, without blocking the loop. Raises EtcdError as ``Watch``."""

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
        deliver: Callable[[WatchNotice], None] = on_notice  # by the loop's hub, on the loop
        hub = _hub(client)
        if not isinstance(hub, LoopHub):  # the threaded stream's reader hands each notice over
            deliver = functools.partial(call_soon, asyncio.get_running_loop(), self._handed)
        super().__init__(
            client, key, start_revision, deliver, range_end, only_deletes, confirm, hub
        )

    @classmethod
    async def open(
        cls: Callable[Concatenate[Client, P], T], client: Client, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """A LoopWatch (arguments as ``LoopWatch``), once the stream's auth token is at hand:
        opening the stream (if it is not open) then makes no call that waits, since gRPC
        starts a stream without waiting for its answer."""
        await client.token_async()
        return cls(client, *args, **kwargs)

    def _handed(self, notice: WatchNotice) -> None:  # on the loop, once handed over
        if not self._cancelled:
            self._on_notice(notice)


def keepalive(
    client: Client, lease_id: int, deadline: float, done: Callable[[lease.Outcome], None]
) -> None:
    """One LeaseKeepAlive of ``lease_id`` on the client's keepalive stream of the running
    loop (shared with every coroutine session of the client: ``lease.LoopKeepAlives``):
    ``done(outcome)`` once, on the loop, as ``lease.KeepAlives.refresh`` ends (the TTL in
    seconds; LeaseNotFound, Unavailable by ``deadline``), called by the stream's reader or
    the deadline's timer: no task, no future per keepalive."""
    keepalives = _keepalives(client)
    if isinstance(keepalives, lease.LoopKeepAlives):
        # Its deadline is a timer of this loop: no thread that could be late to watch for.
        keepalives.refresh(lease_id, deadline, done)
        return
    # Resolved from the keepalives' timer thread, whose lateness the wait bounds.
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[lease.Outcome] = loop.create_future()
    answer.add_done_callback(lambda _: done(answer.result()))
    loop.call_later(lease.wait_for(deadline), resolve, answer, Unavailable(lease.NO_ANSWER))
    keepalives.refresh(lease_id, deadline, functools.partial(call_soon, loop, resolve, answer))


def forget_lease(client: Client, lease_id: int) -> None:
    """Stop keeping ``lease_id`` alive on the client's keepalive stream (no wait; on the
    loop's thread)."""
    _keepalives(client).forget(lease_id)
