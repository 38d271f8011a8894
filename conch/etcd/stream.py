"""The bidirectional streams (Watch.Watch, Lease.LeaseKeepAlive) of a Client, read by a
thread of their own (``BidiStream``) or by a task of an event loop (``LoopStream``, grpc.aio).
Both deliver ``StreamItem``s to one callback: one per response, then one with ``error`` set
when the stream ends."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from conch import log
from conch.errors import EtcdError, TokenInvalid, Unavailable
from conch.etcd.retry import map_rpc_error

if TYPE_CHECKING:
    from conch.etcd.client import Client
    from conch.etcd.endpoints import Endpoint


Deliver = Callable[["StreamItem"], None]


class _Stream:
    """What both kinds share: the call, its request queue, and the end of its reading."""

    _requests: Any  # a queue.SimpleQueue, or an asyncio.Queue: both have put_nowait

    def _open(self, client: Client, deliver: Deliver, token: str | None, call: Any) -> None:
        self._client, self._deliver, self.token = client, deliver, token
        self._closed = False
        self.endpoint, self._call = call

    def send(self, request: Any) -> None:
        self._requests.put_nowait(request)

    def close(self) -> None:
        self._closed = True
        self._requests.put_nowait(None)
        self._call.cancel()

    def _hand_over(self, item: StreamItem) -> None:
        self._deliver(item)

    def _ended(self, rpc_error: grpc.RpcError | None) -> None:
        """The responses ended: by the server (``rpc_error`` None) or with ``rpc_error``."""
        error: EtcdError = Unavailable(f"stream closed by server ({self.endpoint})")
        if rpc_error is not None:
            error = map_rpc_error(rpc_error, self.endpoint)
        if isinstance(error, TokenInvalid):
            self._client.invalidate_token(self.token)
        if not self._closed:
            self._hand_over(StreamItem(self, None, error))  # type: ignore[arg-type]


class BidiStream(_Stream):
    """A bidirectional gRPC stream on ``endpoint`` (default: the client's current one).
    ``send()`` queues a request; a reader thread hands ``deliver`` one ``StreamItem`` per
    response, then one with ``error`` set when the stream ends for any reason (TokenInvalid
    also invalidates the token it was opened with, so the owner's next stream carries a fresh
    one). ``timeout`` (seconds) bounds the Auth.Authenticate that opening may need.
    ``close()`` cancels the call; nothing is delivered after it."""

    def __init__(
        self,
        client: Client,
        service: str,
        method: str,
        deliver: Deliver,
        timeout: float | None = None,
        endpoint: Endpoint | None = None,
    ) -> None:
        import queue

        self._requests = queue.SimpleQueue()
        token = client.token(timeout)
        requests = iter(self._requests.get, None)
        call = client.open_stream(service, method, requests, token=token, endpoint=endpoint)
        self._open(client, deliver, token, call)
        self._reader = threading.Thread(target=self._read, name=f"conch-{method}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                if self._closed:
                    return
                self._deliver(StreamItem(self, response, None))
        except grpc.RpcError as rpc_error:
            self._ended(rpc_error)
        else:
            self._ended(None)


class LoopStream(_Stream):
    """A BidiStream on the running event loop (grpc.aio), read by a task of that loop, so
    no thread of ours hands its answers over. The same ``deliver`` (called on the loop; an
    exception it raises is logged, the stream reads on), ``send()`` and ``close()``, all on
    the loop's thread. Opening waits for nothing: ``token`` is the auth token to carry
    (``Client.token_async`` first), None without credentials."""

    def __init__(
        self,
        client: Client,
        service: str,
        method: str,
        deliver: Deliver,
        token: str | None,
        endpoint: Endpoint | None = None,
    ) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        self._requests = asyncio.Queue()
        requests = self._outgoing()
        call = client.open_stream(service, method, requests, None, token, endpoint, loop)
        self._open(client, deliver, token, call)
        self._reader = loop.create_task(self._read())

    async def _outgoing(self) -> AsyncIterator[Any]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        import asyncio

        try:
            async for response in self._call:
                if self._closed:
                    return
                self._hand_over(StreamItem(self, response, None))
        except asyncio.CancelledError:  # close(), or the loop's end
            return
        except grpc.RpcError as rpc_error:
            self._ended(rpc_error)
        else:
            self._ended(None)

    def _hand_over(self, item: StreamItem) -> None:
        try:
            self._deliver(item)
        except Exception as exc:  # a bug (or a listener's) must not stop the stream
            log.error("stream-answer-failed", error=repr(exc))


# Either kind of stream: what the keepalives and the watch hub hold.
Stream = BidiStream | LoopStream


class StreamItem(NamedTuple):
    """One thing a stream delivers: a response, or (last) the error that ended it."""

    stream: Stream
    response: Any
    error: EtcdError | None
