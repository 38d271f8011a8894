"""The bidirectional streams (Watch.Watch, Lease.LeaseKeepAlive) of a Client, read by a
thread of their own (``BidiStream``) or by a task of an event loop (``LoopStream``, grpc.aio).
Both deliver ``StreamItem``s to one callback: one per response, then one with ``error`` set
when the stream ends."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import grpc

from conch import log
from conch.errors import EtcdError, TokenInvalid, Unavailable
from conch.etcd.client import Client, Endpoint, map_rpc_error


class BidiStream:
    """A bidirectional gRPC stream on ``endpoint`` (default: the client's current one) that
    carries ``token`` (from ``Client.token``; None without credentials). ``send()`` queues a
    request; a reader thread hands ``deliver`` one ``StreamItem`` per response, then one with
    ``error`` set when the stream ends (TokenInvalid also invalidates ``token``, so the
    owner's next stream carries a fresh one); an exception ``deliver`` raises is logged, the
    stream reads on. ``close()`` cancels it; nothing comes after."""

    _requests: Any  # a queue.SimpleQueue, or an asyncio.Queue: both have put_nowait

    def __init__(
        self,
        client: Client,
        service: str,
        method: str,
        deliver: Callable[[StreamItem], None],
        token: str | None,
        endpoint: Endpoint | None = None,
    ) -> None:
        self._client, self._deliver, self.token = client, deliver, token
        self._closed = False
        self.error: EtcdError | None = None  # what ended it, once it has ended
        requests, loop = self._queue()
        opened = client.open_stream(service, method, requests, None, token, endpoint, loop)
        self.endpoint, self._call = opened
        self._reader = self._start(method)  # a task must be referenced while it runs

    def _queue(self) -> tuple[Any, asyncio.AbstractEventLoop | None]:
        """The requests' iterator for the call, and the loop it runs on (None: blocking)."""
        self._requests = queue.SimpleQueue()
        return iter(self._requests.get, None), None

    def _start(self, method: str) -> Any:
        threading.Thread(target=self._read, name=f"conch-{method}", daemon=True).start()

    def send(self, request: Any) -> None:
        self._requests.put_nowait(request)

    def close(self) -> None:
        self._closed = True
        self._requests.put_nowait(None)
        self._call.cancel()

    def _read(self) -> Any:
        try:
            for response in self._call:
                self._hand_over(StreamItem(self, response, None))
        except grpc.RpcError as rpc_error:
            self._ended(rpc_error)
        else:
            self._ended(None)

    def _hand_over(self, item: StreamItem) -> None:
        if self._closed:  # nothing comes after close()
            return
        try:
            self._deliver(item)
        except Exception as exc:  # a bug (or a listener's) must not stop the stream
            log.error("stream-answer-failed", error=repr(exc))

    def _ended(self, rpc_error: grpc.RpcError | None) -> None:
        error: EtcdError = Unavailable(f"stream closed by server ({self.endpoint})")
        if rpc_error is not None:
            error = map_rpc_error(rpc_error, self.endpoint)
        if isinstance(error, TokenInvalid):
            self._client.invalidate_token(self.token)
        self.error = error
        self._hand_over(StreamItem(self, None, error))


class LoopStream(BidiStream):
    """A BidiStream on the running event loop (grpc.aio; ``token`` from ``token_async``),
    read by a task of it: ``deliver`` is called on the loop, ``send()`` and ``close()`` too.
    Opening waits for nothing."""

    def _queue(self) -> tuple[AsyncIterator[Any], asyncio.AbstractEventLoop]:
        self._requests = asyncio.Queue()
        return self._outgoing(), asyncio.get_running_loop()

    def _start(self, method: str) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._read())

    async def _outgoing(self) -> AsyncIterator[Any]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self._hand_over(StreamItem(self, response, None))
        except asyncio.CancelledError:  # close(), or the loop's end
            return
        except grpc.RpcError as rpc_error:
            self._ended(rpc_error)
        else:
            self._ended(None)


Stream = BidiStream  # either kind (a LoopStream is one): what the keepalives and the hub hold


class StreamItem(NamedTuple):
    """One thing a stream delivers: a response, or (last) the error that ended it."""

    stream: Stream
    response: Any
    error: EtcdError | None
