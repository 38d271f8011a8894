"""Lease calls: LeaseGrant, LeaseRevoke, LeaseTimeToLive, and the LeaseKeepAlive stream."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd.client import Backoff, BidiStream, Client, StreamItem
from conch.flag import Flag


class Grant(NamedTuple):
    """A granted lease: ``id`` as etcd numbers it, ``ttl`` in whole seconds as etcd granted it."""

    id: int
    ttl: int


def grant(
    client: Client, ttl: int, timeout: float | None = None, interrupt: Flag | None = None
) -> Grant:
    """Lease.LeaseGrant for ``ttl`` seconds (etcd may raise it to its minimum); ``interrupt``
    as in ``Client.call``."""
    request = rpc_pb2.LeaseGrantRequest(TTL=ttl)
    response = client.call("lease", "LeaseGrant", request, timeout, interrupt=interrupt)
    if response.error:
        raise EtcdError(f"lease grant refused: {response.error}")
    return Grant(response.ID, response.TTL)


def revoke(client: Client, lease_id: int, timeout: float | None = None) -> None:
    """Lease.LeaseRevoke: the lease and every key attached to it go at once.

    A lease that is already gone counts as revoked."""
    with contextlib.suppress(LeaseNotFound):
        client.call("lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout)


def time_to_live(client: Client, lease_id: int, timeout: float | None = None) -> int:
    """Lease.LeaseTimeToLive: seconds the lease has left; -1 when it is gone."""
    response = client.call(
        "lease", "LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id), timeout
    )
    return int(response.TTL)


# With several endpoints, a keepalive unanswered for this long (or half the time left, if
# less) is also sent to the next member, while the first stream keeps listening: the first
# answer counts. A slow link then costs nothing, a silent member costs this much.
ASK_ANOTHER_AFTER = 0.5  # seconds


class KeepAlive:
    """The LeaseKeepAlive stream of one lease.

    ``refresh(deadline)`` sends one keepalive and waits for etcd's answer until ``deadline``
    (a ``time.monotonic()`` value). A stream that breaks is dropped and the client fails over.
    A stream that is only silent is kept: after ASK_ANOTHER_AFTER the keepalive also goes to
    the next member, on a stream of its own, and whichever answers first counts, so a late
    answer on a slow link is never thrown away for a new connection over that same link.
    When another member answered and the first stream stayed silent, the client fails over
    from it (``Client.on_failover`` listeners, e.g. watches, follow).
    """

    def __init__(self, client: Client, lease_id: int) -> None:
        self._client = client
        self._lease_id = lease_id
        self._answers: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        # Open streams, first the one in use, with how many answers each has delivered: a
        # stream answers its keepalives in order, so an answer that comes after a refresh
        # gave up on it belongs to that refresh and must not confirm a later one.
        self._streams: dict[BidiStream, _Counts] = {}
        self._lock = threading.Lock()
        self._closed = False

    def refresh(self, deadline: float) -> int:
        """Return the lease's TTL in seconds after this keepalive.

        Raises LeaseNotFound when etcd answers TTL <= 0 (expired or revoked), Unavailable when
        no answer comes by ``deadline``."""
        backoff = Backoff()
        last_error: EtcdError = Unavailable("keepalive: no answer in time")
        asked: dict[BidiStream, int] = {}  # stream -> index of its answer to this keepalive
        ask_at = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= ask_at:
                try:
                    stream = self._stream_to_ask(asked, deadline)
                except EtcdError as exc:
                    last_error = exc
                    ask_at = now + backoff.next()
                    continue
                if stream is None:
                    ask_at = deadline  # every endpoint has it: wait for any answer
                else:
                    asked[stream] = self._send(stream)
                    ask_at = now + min(ASK_ANOTHER_AFTER, (deadline - now) / 2)
            item = self._next_answer(min(deadline, ask_at))
            if item is None:
                continue
            if item.error is not None:
                last_error = item.error
                self._drop(item.stream)
                self._client.failover(item.stream.endpoint)
                asked.pop(item.stream, None)
                if not asked:
                    ask_at = min(ask_at, time.monotonic() + backoff.next())
                continue
            counts = self._streams.get(item.stream)
            if counts is None:
                continue  # closed meanwhile
            index = counts.received
            counts.received += 1
            if index < asked.get(item.stream, counts.sent):
                continue  # the late answer to an earlier keepalive
            self._settle_on(item.stream, asked)
            if item.response.TTL <= 0:
                raise LeaseNotFound(f"lease {self._lease_id:x} expired or was revoked")
            return int(item.response.TTL)
        raise Unavailable(f"keepalive: no answer in time ({last_error})")

    def _stream_to_ask(self, asked: dict[BidiStream, int], deadline: float) -> BidiStream | None:
        """The stream to send this keepalive on next: the one in use, else one to the member
        after the last one asked (None when every endpoint has been asked). Opening one may
        need an Auth.Authenticate, bounded by ``deadline``."""
        with self._lock:
            current = next(iter(self._streams), None)
        if not asked and current is not None:
            return current
        endpoints = self._client.endpoints
        busy = {s.endpoint for s in self._streams}
        if asked:
            start = endpoints.index(list(asked)[-1].endpoint) + 1
        else:
            start = endpoints.index(self._client.endpoint)
        for step in range(len(endpoints)):
            endpoint = endpoints[(start + step) % len(endpoints)]
            if endpoint not in busy:
                stream = BidiStream(
                    self._client,
                    "lease",
                    "LeaseKeepAlive",
                    self._answers.put,
                    timeout=max(0.001, deadline - time.monotonic()),
                    endpoint=endpoint,
                )
                with self._lock:  # close() from another thread must not miss it
                    if not self._closed:
                        self._streams[stream] = _Counts()
                        return stream
                stream.close()
                raise Unavailable("keepalive closed")
        return None

    def _send(self, stream: BidiStream) -> int:
        """Send one keepalive on ``stream``; return the index its answer will have."""
        counts = self._streams.get(stream, _Counts())
        counts.sent += 1
        stream.send(rpc_pb2.LeaseKeepAliveRequest(ID=self._lease_id))
        return counts.sent - 1

    def _settle_on(self, answered: BidiStream, asked: dict[BidiStream, int]) -> None:
        """Keep only the stream that answered. If the first one asked stayed silent, its
        member is at best slower than this one: calls and streams move away from it."""
        silent = next(iter(asked))
        for stream in list(self._streams):
            if stream is not answered:
                self._drop(stream)
        if silent is not answered:
            self._client.failover(silent.endpoint)

    def _next_answer(self, deadline: float) -> StreamItem | None:
        """The next item of an open stream (stale items of dropped streams are skipped)."""
        while True:
            try:
                item = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if item.stream in self._streams:
                return item

    def _drop(self, stream: BidiStream) -> None:
        with self._lock:
            self._streams.pop(stream, None)
        stream.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams), {}
        for stream in streams:
            stream.close()


class _Counts:
    """Keepalives sent on one stream, and answers received on it."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
