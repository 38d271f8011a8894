"""Lease calls: LeaseGrant, LeaseRevoke, LeaseTimeToLive, and the LeaseKeepAlive stream."""

from __future__ import annotations

import contextlib
import queue
import time
from dataclasses import dataclass

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd.client import Backoff, BidiStream, Client, StreamItem
from conch.flag import Flag


@dataclass(frozen=True)
class Grant:
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


class KeepAlive:
    """The LeaseKeepAlive stream of one lease.

    ``refresh(deadline)`` sends one keepalive and waits for etcd's answer until ``deadline``
    (a ``time.monotonic()`` value), re-opening the stream on the next endpoint if it breaks.
    """

    def __init__(self, client: Client, lease_id: int) -> None:
        self._client = client
        self._lease_id = lease_id
        self._answers: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        self._stream: BidiStream | None = None
        self._closed = False

    def refresh(self, deadline: float) -> int:
        """Return the lease's TTL in seconds after this keepalive.

        Raises LeaseNotFound when etcd answers TTL <= 0 (expired or revoked), Unavailable when
        no answer comes by ``deadline``."""
        backoff = Backoff()
        last_error: EtcdError = Unavailable("keepalive: no answer in time")
        while time.monotonic() < deadline and not self._closed:
            if self._stream is None:
                try:
                    self._stream = BidiStream(
                        self._client,
                        "lease",
                        "LeaseKeepAlive",
                        self._answers.put,
                        timeout=max(0.001, deadline - time.monotonic()),
                    )
                except EtcdError as exc:
                    last_error = exc
                    time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
                    continue
            stream = self._stream
            stream.send(rpc_pb2.LeaseKeepAliveRequest(ID=self._lease_id))
            item = self._next_answer(stream, self._attempt_deadline(deadline))
            if item is None:
                # A hung member (stopped, partitioned) never answers nor errors: move on.
                last_error = Unavailable(f"no keepalive answer from {stream.endpoint}")
                self._drop(stream)
                continue
            if item.error is None:
                if item.response.TTL <= 0:
                    raise LeaseNotFound(f"lease {self._lease_id:x} expired or was revoked")
                return int(item.response.TTL)
            last_error = item.error
            self._drop(stream)
            time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
        raise Unavailable(f"keepalive: no answer in time ({last_error})")

    def _attempt_deadline(self, deadline: float) -> float:
        """With several endpoints, give one stream at most half the time left (>= 0.5 s)."""
        now = time.monotonic()
        left = deadline - now
        if len(self._client.endpoints) == 1:
            return deadline
        return now + max(min(left, 0.5), left / 2)

    def _next_answer(self, stream: BidiStream, deadline: float) -> StreamItem | None:
        """The next item of this stream (stale items of dropped streams are skipped)."""
        while True:
            try:
                item = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if item.stream is stream:
                return item

    def _drop(self, stream: BidiStream) -> None:
        stream.close()
        self._client.failover(stream.endpoint)
        self._stream = None

    def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.close()
            self._stream = None
