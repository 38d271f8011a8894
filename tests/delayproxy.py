"""Proxies on loopback in front of a real etcd, for faults the test process injects itself.

``DelayProxy``: a TCP proxy on loopback that holds back what the server sends by a fixed delay.

``DelayProxy(("127.0.0.1", etcd_port), delay=1.5)`` listens on ``proxy.port``; what a client
sends goes through at once, what the server answers reaches the client ``delay`` seconds
after it arrived, in order. A slow link in one direction, for the test process's own
client, without a network namespace. ``delay`` may be changed: what arrives from then on is
held back by the new one. ``cut()`` ends every connection so far, dropping what it holds back
(a link that breaks), and still accepts new ones; ``close()`` ends every connection.

``FaultProxy``: etcd's gRPC API call by call (a request refused with a status, held, or
slowed; an answer lost after etcd applied the request; streams broken), and a record of
every message passed on, for a test to count or read what a client asked of etcd.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from conchpb.etcdserverpb import rpc_pb2

from conch.etcd import Client, Endpoint


class DelayProxy:
    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self._target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = False
        threading.Thread(target=self._accept, name="delayproxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            for target, args in (
                (_pump, (client, server)),
                (_hold, (server, held, lambda: self.delay)),
                (_release, (held, client)),
            ):
                threading.Thread(target=target, args=args, daemon=True).start()

    def cut(self) -> None:
        connections, self._sockets[1:] = self._sockets[1:], []
        _shut(connections)

    def close(self) -> None:
        self._closed = True
        _shut(self._sockets)


def _shut(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Client to server, at once."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _hold(
    source: socket.socket,
    held: queue.SimpleQueue[tuple[float, bytes]],
    delay: Callable[[], float],
) -> None:
    """Server to client: each chunk stamped with when it may go on."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            held.put((time.monotonic() + delay(), data))
    held.put((time.monotonic() + delay(), b""))


def _release(held: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))  # the delay itself, not a wait for a state
            if not data:
                sink.shutdown(socket.SHUT_WR)
                return
            sink.sendall(data)


# -- a fault proxy: etcd's gRPC, call by call -------------------------------------------------


class Refuse(Exception):
    """Raised by a hook: the call (or stream) ends with gRPC status ``code`` and ``details``
    (etcd's words, e.g. ``"etcdserver: requested lease not found"``) instead."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True)
class Seen:
    """One message the proxy passed on: ``method`` as etcd names it (``Range``, ``Txn``,
    ``Watch``, ``LeaseKeepAlive``...), ``sent`` by the client (else etcd's answer), parsed."""

    method: str
    sent: bool
    message: Any


Hook = Callable[[Any, "grpc.ServicerContext"], None]


class FaultProxy:
    """A gRPC proxy on loopback in front of one etcd member (``target``, ``host:port``) that
    both faces reach as any endpoint (``proxy.endpoint``): every call and stream message is
    passed on as etcd sent it, recorded in ``seen`` in the order it was passed on (so a
    request the client made after an answer comes after it), and a test may make etcd
    misbehave for one method at a time:

    * ``before(method, hook)``: ``hook(request, context)`` runs before the request goes on
      (each message of a stream too): it may wait (a slow or held request, see ``Gate``),
      act on etcd from outside first, or raise ``Refuse`` (the call never reaches etcd);
    * ``after(method, hook)``: ``hook(response, context)`` runs once etcd answered a unary
      call, before the answer goes back: raising ``Refuse`` loses an answer to a request
      etcd applied; ``lose_answer`` withholds it until the caller gave up;
    * ``break_streams()``: every stream open now ends with UNAVAILABLE (a broken link).

    A hook is removed by the function ``before``/``after`` return, or after ``times`` calls.
    """

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=64), handlers=[_Proxied(self)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self.seen: list[Seen] = []
        self._hooks: dict[tuple[str, str], list[list[Any]]] = {}  # (when, method): [hook, left]
        self._streams: dict[Any, tuple[str, bool]] = {}  # upstream call: method, broken by us
        self._lock = threading.Lock()
        self._server.start()

    def client(self, **kwargs: Any) -> Client:
        """A conch client of its own whose every call goes through this proxy."""
        return Client.connect([Endpoint.parse(self.endpoint)], **kwargs)

    def before(self, method: str, hook: Hook, times: int | None = None) -> Callable[[], None]:
        return self._add("before", method, hook, times)

    def after(self, method: str, hook: Hook, times: int | None = None) -> Callable[[], None]:
        return self._add("after", method, hook, times)

    def _add(self, when: str, method: str, hook: Hook, times: int | None) -> Callable[[], None]:
        entry = [hook, times]
        with self._lock:
            self._hooks.setdefault((when, method), []).append(entry)

        def remove() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._hooks[(when, method)].remove(entry)

        return remove

    def _run(self, when: str, method: str, message: Any, context: Any) -> None:
        with self._lock:
            due = []
            for entry in list(self._hooks.get((when, method), [])):
                due.append(entry[0])
                if entry[1] is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        self._hooks[(when, method)].remove(entry)
        for hook in due:
            hook(message, context)

    def requests(self, *methods: str, since: int = 0) -> list[Any]:
        """What the client sent of ``methods`` (all if none), from ``seen[since]`` on."""
        return [
            s.message for s in self.seen[since:] if s.sent and (not methods or s.method in methods)
        ]

    def streams(self, method: str) -> int:
        """How many ``method`` streams (``Watch``, ``LeaseKeepAlive``) are open through it now."""
        with self._lock:
            return sum(m == method for m, _ in self._streams.values())

    def break_streams(self) -> None:
        with self._lock:
            calls = list(self._streams)
            for call in calls:
                self._streams[call] = (self._streams[call][0], True)
        for call in calls:
            call.cancel()

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def _unary(self, path: str, request: bytes, context: Any) -> bytes:
        method, (parse_request, parse_response) = _name(path), _TYPES[path]
        message = parse_request(request)
        self.seen.append(Seen(method, True, message))
        try:
            self._run("before", method, message, context)
            remaining = context.time_remaining()
            response: bytes = self._channel.unary_unary(path, None, None)(
                request,
                timeout=None if remaining is None or remaining > 3600 else remaining,
                metadata=_forwarded(context),
            )
            answer = parse_response(response)
            self._run("after", method, answer, context)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())
        except Refuse as refused:
            context.abort(refused.code, refused.details)
        self.seen.append(Seen(method, False, answer))
        return response

    def _stream(self, path: str, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        method, (parse_request, parse_response) = _name(path), _TYPES[path]
        refused: list[Refuse] = []

        def upward() -> Iterator[bytes]:
            for request in requests:
                message = parse_request(request)
                self.seen.append(Seen(method, True, message))
                try:
                    self._run("before", method, message, context)
                except Refuse as exc:
                    refused.append(exc)
                    call.cancel()
                    return
                yield request

        call: Any = self._channel.stream_stream(path, None, None)(
            upward(), metadata=_forwarded(context)
        )
        with self._lock:
            self._streams[call] = (method, False)
        context.add_callback(call.cancel)
        try:
            for response in call:
                self.seen.append(Seen(method, False, parse_response(response)))
                yield response
        except grpc.RpcError as exc:
            with self._lock:
                broken = self._streams.get(call, (method, False))[1]
            if refused:
                context.abort(refused[0].code, refused[0].details)
            if broken:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream broken by the fault proxy")
            context.abort(exc.code(), exc.details())
        finally:
            with self._lock:
                self._streams.pop(call, None)


class Gate:
    """A hook that holds each request (or answer) it sees until ``open()``: ``reached`` is set
    once one waits. Released requests go on as sent; an open gate lets all through."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, message: Any, context: Any) -> None:
        self.reached.set()
        self._open.wait(60)

    def open(self) -> None:
        self._open.set()


def lose_answer(message: Any, context: Any) -> None:
    """An ``after`` hook: etcd applied the request, its answer never comes (withheld until the
    caller's deadline passed or it gave up)."""
    gone = threading.Event()
    context.add_callback(gone.set)
    remaining = context.time_remaining()
    gone.wait(60 if remaining is None else min(remaining + 1.0, 60))
    raise Refuse(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost")


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def _forwarded(context: Any) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata etcd reads (its auth ``token``, ``hasleader``)."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata()
        if not key.startswith((":", "grpc-")) and key != "user-agent"
    )


_TYPES: dict[str, tuple[Callable[[bytes], Any], Callable[[bytes], Any]]] = {}
_STREAMS: set[str] = set()
for _service in rpc_pb2.DESCRIPTOR.services_by_name.values():
    for _method in _service.methods:
        _path = f"/{_service.full_name}/{_method.name}"
        _TYPES[_path] = (
            getattr(rpc_pb2, _method.input_type.name).FromString,
            getattr(rpc_pb2, _method.output_type.name).FromString,
        )
        if _method.client_streaming and _method.server_streaming:
            _STREAMS.add(_path)


class _Proxied(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        path = details.method
        if path in _STREAMS:
            return grpc.stream_stream_rpc_method_handler(partial(self._proxy._stream, path))
        if path in _TYPES:
            return grpc.unary_unary_rpc_method_handler(partial(self._proxy._unary, path))
        return None


def deletes(seen: Seen, key: bytes) -> bool:
    """Whether ``seen`` is a watch notice etcd sent that carries the deletion of ``key``."""
    return (
        not seen.sent
        and seen.method == "Watch"
        and any(e.type == e.DELETE and e.kv.key == key for e in seen.message.events)
    )


def watch_created(seen: list[Seen], prefix_only: bool = True) -> bool:
    """Whether etcd confirmed a watch the client asked for (``prefix_only``: of a range, as a
    waiter in the window watches the deletions under the semaphore's prefix)."""
    asked = [
        i
        for i, s in enumerate(seen)
        if s.sent
        and s.method == "Watch"
        and s.message.HasField("create_request")
        and (s.message.create_request.range_end or not prefix_only)
    ]
    return bool(asked) and any(
        not s.sent and s.method == "Watch" and s.message.created for s in seen[asked[0] + 1 :]
    )
