"""The Watch stream: a key or range watched from a start revision, events delivered to a
mailbox."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.errors import Compacted, EtcdError, Unavailable
from conch.etcd.client import Backoff, BidiStream, Client, Endpoint, StreamItem

PUT = kv_pb2.Event.PUT
DELETE = kv_pb2.Event.DELETE
# A member that hangs (stopped, swapping, cut off without closing connections) leaves a
# watch silent, and gRPC's own pings take long to give up on it. So a watch silent for
# PROBE_AFTER seconds asks etcd for a progress report (Watch.Watch progress_request, etcd
# 3.4+); no answer within PROBE_TIMEOUT seconds and the stream moves to the next endpoint.
PROBE_AFTER = 10.0
PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class WatchNotice:
    """What a Watch delivers: ``events`` (etcd mvccpb.Event list) and the response's header
    ``revision``; with ``confirm``, ``created`` once etcd has confirmed the watch
    (``revision`` is then the revision the watch covers from, exclusive); or, last,
    ``error`` (Compacted with the oldest revision left, or another EtcdError) when the watch
    ended."""

    watch: Watch
    events: Sequence[kv_pb2.Event]
    revision: int
    error: EtcdError | None = None
    created: bool = False


class Watch:
    """Watch.Watch on one key, or on the range ``[key, range_end)`` when ``range_end`` is
    given, from ``start_revision`` on (0: from now). Notices go to ``deliver`` from a reader
    thread, events in revision order (one etcd watcher). ``only_deletes`` asks etcd to filter
    out PUT events; ``confirm`` asks for a ``created`` notice once etcd has set the watch up.
    ``cancel()`` stops delivery.

    When the stream breaks (a member goes away) or stays silent through a progress request
    (a hung member, see PROBE_AFTER), the watch moves to the next endpoint and resumes just
    after the last revision it delivered, so no event is lost or repeated; only after
    ``MAX_RESUMES`` failed attempts in a row is the error delivered. It also moves, the same
    way, when the client's calls or keepalive fail over from the member it is on
    (``Client.on_failover``): a member we cannot reach leaves a watch silent, not broken,
    until the connection times out.
    """

    MAX_RESUMES = 3

    def __init__(
        self,
        client: Client,
        key: bytes,
        start_revision: int,
        deliver: Callable[[WatchNotice], None],
        range_end: bytes = b"",
        only_deletes: bool = False,
        confirm: bool = False,
        probe_after: float = PROBE_AFTER,
    ) -> None:
        self._client = client
        self._confirm = confirm
        self._deliver = deliver
        self._cancelled = False
        self._filters = [rpc_pb2.WatchCreateRequest.NOPUT] if only_deletes else []
        self._key = key
        self._range_end = range_end
        self._next = start_revision  # first revision still owed; 0 until etcd says "now"
        self._failures = 0
        self._backoff = Backoff()
        self._generation = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()  # cancelled, or the error delivered
        self._heard = time.monotonic()  # when the current stream last answered
        self._unsubscribe: Callable[[], None] = lambda: None
        self._stream = self._open()
        self._unsubscribe = client.on_failover(self._on_failover)
        if self._ended.is_set():  # ended before we subscribed
            self._unsubscribe()
        threading.Thread(
            target=self._probe, args=(probe_after,), name="conch-watch-probe", daemon=True
        ).start()

    def _open(self) -> BidiStream:
        # Items of an older stream are stale; the generation is fixed before the new stream
        # can deliver anything.
        self._generation += 1
        generation = self._generation
        self._heard = time.monotonic()
        stream = BidiStream(
            self._client, "watch", "Watch", lambda item: self._on_item(item, generation)
        )
        stream.send(
            rpc_pb2.WatchRequest(
                create_request=rpc_pb2.WatchCreateRequest(
                    key=self._key,
                    range_end=self._range_end,
                    start_revision=self._next,
                    filters=self._filters,
                )
            )
        )
        return stream

    def cancel(self) -> None:
        with self._lock:  # no stream is re-opened after this
            self._cancelled = True
            stream = self._stream
        self._end()
        stream.close()

    def _end(self) -> None:
        self._ended.set()
        self._unsubscribe()

    def _on_failover(self, failed: Endpoint) -> None:
        """Calls moved off ``failed``: if this watch is on it, move it too (in a thread of its
        own, since the one that failed over may be the keepalive's)."""
        stream = self._stream
        if stream.endpoint == failed and not self._ended.is_set():
            threading.Thread(
                target=self._move, args=(stream,), name="conch-watch-move", daemon=True
            ).start()

    def _move(self, stream: BidiStream) -> None:
        try:
            with self._lock:
                if stream is not self._stream or self._cancelled:
                    return
                # _open() makes anything the old stream still says stale.
                self._stream = self._open()
        except EtcdError as exc:
            self._end()
            self._deliver(WatchNotice(self, (), 0, exc))
        stream.close()

    def _probe(self, after: float) -> None:
        """Ask a silent stream for a progress report; if none comes, treat it as broken."""
        while not self._ended.wait(max(0.0, self._heard + after - time.monotonic())):
            stream, asked = self._stream, time.monotonic()
            if asked - self._heard < after:
                continue
            stream.send(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
            if self._ended.wait(PROBE_TIMEOUT) or self._heard >= asked:
                continue
            with self._lock:
                if stream is not self._stream or self._cancelled:
                    continue
                self._generation += 1  # anything the silent stream still says is stale
            stream.close()
            error = Unavailable(f"watch: {stream.endpoint} did not answer in {PROBE_TIMEOUT:g}s")
            self._resume_or_fail(StreamItem(stream, None, error))

    def _on_item(self, item: StreamItem, generation: int) -> None:
        if self._cancelled or generation != self._generation:
            return
        self._heard = time.monotonic()
        if item.error is not None:
            self._resume_or_fail(item)
            return
        response = item.response
        revision = response.header.revision
        if response.canceled:
            error: EtcdError
            if response.compact_revision:
                error = Compacted(
                    f"watch start revision compacted (oldest left {response.compact_revision})",
                    response.compact_revision,
                )
            else:
                error = EtcdError(f"watch cancelled by etcd: {response.cancel_reason}")
            self._deliver(WatchNotice(self, (), revision, error))
            self.cancel()
        elif response.created:
            self._failures = 0
            if self._next == 0:
                self._next = revision + 1  # "from now" is this revision on
            if self._confirm:
                self._deliver(WatchNotice(self, (), revision, created=True))
        elif response.events:
            self._failures = 0
            self._next = response.events[-1].kv.mod_revision + 1
            self._deliver(WatchNotice(self, list(response.events), revision))

    def _resume_or_fail(self, item: StreamItem) -> None:
        """Called from the broken stream's reader thread: reopen on the next endpoint."""
        assert item.error is not None
        self._failures += 1
        if not isinstance(item.error, Unavailable) or self._failures > self.MAX_RESUMES:
            self._end()
            self._deliver(WatchNotice(self, (), 0, item.error))
            return
        self._client.failover(item.stream.endpoint)
        time.sleep(self._backoff.next())
        if self._cancelled:
            return
        try:
            with self._lock:
                # Our own failover above may have moved the watch already (_on_failover).
                if self._cancelled or self._stream is not item.stream:
                    return
                self._stream = self._open()
        except EtcdError as exc:
            self._end()
            self._deliver(WatchNotice(self, (), 0, exc))
