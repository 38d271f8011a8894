"""Watches: a key or range watched from a start revision, events delivered to a callback.
All the watches of one Client share one Watch.Watch stream (one reader, not one per watch)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.errors import Compacted, EtcdError, TokenInvalid, Unavailable
from conch.etcd.client import Backoff, Client, Endpoint
from conch.etcd.lease import live
from conch.etcd.loop import call_soon, running_loop
from conch.etcd.stream import BidiStream, LoopStream, Stream, StreamItem
from conch.timer import PerOwner, Scheduler, timer_for

# A hung member leaves a watch silent, and gRPC's pings are slow to give up: silent PROBE_AFTER
# seconds, a stream asks for a progress report (etcd 3.4+); none in PROBE_TIMEOUT, it moves.
PROBE_AFTER = 10.0
PROBE_TIMEOUT = 5.0
# Seconds the stream stays open with no watch: a waiter or a new hold replacing a watch has
# none for a moment, and a new stream would cost the handoff a stream set-up.
IDLE_CLOSE = 2.0
# What etcd's reason says when it cancelled a watch for its token or permissions.
_REFUSALS = ("permission denied", "auth token", "revision of auth store is old")


class WatchNotice(NamedTuple):
    """What a Watch delivers: ``events`` (mvccpb.Event list) and the header ``revision``;
    with ``confirm``, ``created`` once etcd set the watch up (``revision``: covered from,
    exclusive); or, last, ``error`` (Compacted with the oldest revision left, or another
    EtcdError) when the watch ended."""

    watch: Watch
    events: Sequence[kv_pb2.Event]
    revision: int
    error: EtcdError | None = None
    created: bool = False


class Watch:
    """Watch.Watch on ``key``, or ``[key, range_end)``, from ``start_revision`` on (0: from
    now). Notices go to ``deliver`` from the stream's reader, events in revision order;
    ``deliver`` must not block. ``only_deletes``: etcd filters out PUTs (NOPUT);
    ``confirm``: a ``created`` notice once etcd set the watch up. Raises EtcdError when the
    client's stream is not open and cannot be opened.

    A stream that breaks, stays silent through a progress request (PROBE_AFTER
    seconds), or whose endpoint calls failed over from, moves to the next endpoint; every
    watch resumes just after the last revision it delivered (no event lost or repeated).
    The error is delivered only after ``MAX_RESUMES`` failed attempts in a row."""

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
        hub: _Hub | None = None,
    ) -> None:
        self._confirm = confirm
        self._deliver = deliver
        filters = [rpc_pb2.WatchCreateRequest.NOPUT] if only_deletes else []
        self._create = rpc_pb2.WatchCreateRequest(key=key, range_end=range_end, filters=filters)
        self._next = start_revision  # first revision still owed; 0 until etcd says "now"
        self._id: int | None = None  # etcd's watch_id on the current stream
        self._cancelled = False
        # Held while a notice is handed over, and by cancel(), so that none is on its way
        # once cancel() returns; reentrant, for a ``deliver`` that cancels its own watch.
        self._delivering = threading.RLock()
        self._hub = _hub_for(client) if hub is None else hub
        self._hub.add(self)

    def cancel(self) -> None:
        """Stop delivery (Watch.Watch cancel_request): nothing is delivered once this returns
        (a notice being delivered by another thread is waited for)."""
        with self._delivering:
            self._cancelled = True
        self._hub.remove(self)


def _hand_over_all(notices: list[WatchNotice]) -> None:
    for notice in notices:
        with notice.watch._delivering:
            if not notice.watch._cancelled:
                notice.watch._deliver(notice)


def _cancel_request(watch_id: int) -> rpc_pb2.WatchRequest:
    return rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=watch_id))


def _cancel_error(response: rpc_pb2.WatchResponse) -> EtcdError:
    if oldest := response.compact_revision:
        return Compacted(f"watch start revision compacted (oldest left {oldest})", oldest)
    return EtcdError(f"watch cancelled by etcd: {response.cancel_reason}")


class _Hub:
    """The one Watch.Watch stream of a Client and the watches on it. State changes under
    ``_lock``, never held across a call that waits on etcd, nor while notices are delivered
    (so a ``deliver`` may cancel or open watches)."""

    def __init__(self, client: Client, timer: Scheduler | None = None) -> None:
        self._client_ref = weakref.ref(client)  # the hub lives in a map keyed by the client
        self._timer: Scheduler = timer_for(client) if timer is None else timer
        self._lock = threading.RLock()
        self._stream: Stream | None = None
        self._watches: set[Watch] = set()
        # Creates not answered yet: etcd answers them in order, later answers by watch_id.
        self._unanswered: collections.deque[Watch] = collections.deque()
        self._by_id: dict[int, Watch] = {}
        self._heard = time.monotonic()  # when the current stream last answered
        self._failures = 0
        self._backoff = Backoff()
        self._left: Endpoint | None = None  # the endpoint of the stream that broke
        self._probing = False
        self._idle_check = False
        self._opening = False  # a stream on its way: opened outside the lock, or a resume due
        client.on_failover(self._endpoint_failed)

    def add(self, watch: Watch) -> None:
        """Register ``watch``, opening the stream if there is none (in this thread, outside
        the lock). Raises EtcdError when that fails: ``watch`` is not registered."""
        with self._lock:
            self._watches.add(watch)
            if self._stream is not None:
                self._send_create(self._stream, watch)
                self._schedule_probe()
                return
            if self._opening:
                return  # created when that stream is up
            self._opening = True
        self._connect(watch)

    def remove(self, watch: Watch) -> None:
        with self._lock:
            if watch not in self._watches:
                return
            self._watches.discard(watch)
            if watch._id is not None and self._stream is not None:
                self._by_id.pop(watch._id, None)
                self._stream.send(_cancel_request(watch._id))
            # Not yet created: its ``created`` answer is matched, then cancelled.
            self._schedule_idle_check()

    def _schedule_idle_check(self) -> None:
        if not self._watches and not self._idle_check:
            self._idle_check = True
            self._timer.call_later(IDLE_CLOSE, self._close_if_idle)

    def _close_if_idle(self) -> None:
        with self._lock:
            self._idle_check = False
            stream = self._stream
            if self._watches or stream is None:
                return
            self._detach()
        stream.close()

    def _open(self) -> Stream:
        # Not under the lock: an Auth.Authenticate or a TLS handshake may take seconds.
        client = live(self._client_ref)
        return BidiStream(client, "watch", "Watch", self._on_item, client.token())

    def _connect(self, withdraw: Watch | None) -> None:
        """Open the stream (by the thread that set ``_opening``) and create every watch on
        it. If that fails, ``withdraw`` goes, the other watches wait for a retry, and the
        EtcdError is raised."""
        try:
            stream = self._open()
        except EtcdError as exc:
            with self._lock:
                self._opening = False
                if withdraw is not None:
                    self._watches.discard(withdraw)
                if self._watches:
                    self._failed(exc, None)
            raise
        with self._lock:
            self._opening = False  # no stream was in place: none is while one is on its way
            self._stream = stream
            self._heard = time.monotonic()
            if stream.error is not None:
                # Its reader starts with it: refused at once (as while etcd restarts) before
                # it was installed. Resume now, not at the probe.
                self._broken(stream, stream.error)
                return
            for watch in list(self._watches):
                self._send_create(stream, watch)
            self._schedule_idle_check()  # every watch cancelled while it opened
            self._schedule_probe()

    def _detach(self) -> None:
        self._stream = None
        self._unanswered.clear()
        self._by_id.clear()

    def _send_create(self, stream: Stream, watch: Watch) -> None:
        watch._id = None
        self._unanswered.append(watch)
        watch._create.start_revision = watch._next
        stream.send(rpc_pb2.WatchRequest(create_request=watch._create))

    def _on_item(self, item: StreamItem) -> None:
        notices: list[WatchNotice] = []
        with self._lock:
            if item.stream is not self._stream:
                return  # a stream we already left, or one not installed yet (``_connect``)
            self._heard = time.monotonic()
            response = item.response
            if item.error is not None:
                self._broken(item.stream, item.error)
            elif response.created:
                if self._unanswered:
                    self._on_created(item, self._unanswered.popleft(), notices)
            elif (watch := self._by_id.get(response.watch_id)) is None or watch._cancelled:
                return  # a progress report, or a watch cancelled meanwhile
            elif response.canceled:
                self._by_id.pop(response.watch_id, None)
                self._end(watch, _cancel_error(response), notices)
            elif response.events:
                self._failures = 0
                events = list(response.events)
                watch._next = events[-1].kv.mod_revision + 1
                notices.append(WatchNotice(watch, events, response.header.revision))
        _hand_over_all(notices)

    def _on_created(self, item: StreamItem, watch: Watch, notices: list[WatchNotice]) -> None:
        response = item.response
        refused = any(words in response.cancel_reason for words in _REFUSALS)
        if response.canceled and item.stream.token and refused:
            # etcd refuses a stale token (an auth change, expired, a restarted member) by
            # cancelling the create, in 3.5 as "permission denied": resume with a fresh
            # token; a real refusal is delivered after MAX_RESUMES attempts.
            live(self._client_ref).invalidate_token(item.stream.token)
            self._broken(item.stream, TokenInvalid(response.cancel_reason))
        elif response.canceled:  # refused (permission denied, bad range)
            self._end(watch, _cancel_error(response), notices)
        elif watch._cancelled or watch not in self._watches:
            item.stream.send(_cancel_request(response.watch_id))
        else:
            self._failures = 0
            self._backoff.reset()
            watch._id = response.watch_id
            self._by_id[response.watch_id] = watch
            revision = response.header.revision
            if watch._next == 0:
                watch._next = revision + 1  # "from now" is this revision on
            if watch._confirm:
                notices.append(WatchNotice(watch, (), revision, created=True))

    def _end(self, watch: Watch, error: EtcdError, notices: list[WatchNotice]) -> None:
        self._watches.discard(watch)
        notices.append(WatchNotice(watch, (), 0, error))  # none if cancelled (_hand_over_all)

    def _broken(self, stream: Stream, error: EtcdError) -> None:
        self._detach()
        stream.close()
        # A stale token is no fault of the member: resume on the same one.
        self._failed(error, stream.endpoint if isinstance(error, Unavailable) else None)

    def _failed(self, error: EtcdError, left: Endpoint | None) -> None:
        """A stream broke or would not open (lock held): resume after a pause (away from
        ``left``) from a member gone away or a stale token (a new stream authenticates
        again), or end every watch with ``error``."""
        self._failures += 1
        if isinstance(error, (Unavailable, TokenInvalid)) and self._failures <= Watch.MAX_RESUMES:
            self._left = left
            self._opening = True
            self._timer.call_later(self._backoff.next(), self._resume)
            return
        notices = [WatchNotice(watch, (), 0, error) for watch in self._watches]
        self._watches.clear()
        self._failures = 0
        self._backoff.reset()
        # Not under the lock, nor from inside a caller that holds it.
        self._timer.call_later(0, lambda: _hand_over_all(notices))

    def _resume(self) -> None:
        client, left, self._left = self._client_ref(), self._left, None
        if client is not None and left is not None:
            client.failover(left)  # not under our lock: it calls failover listeners
        with self._lock:
            if self._stream is not None or not self._watches:
                self._opening = False
                return
        with contextlib.suppress(EtcdError):  # retried, or every watch ended
            self._connect(None)

    def _endpoint_failed(self, failed: Endpoint) -> None:
        # A member that no longer answers calls likely leaves its watchers silent.
        client = self._client_ref()
        if client is None or client.endpoint == failed:
            return  # one endpoint only: nowhere to move, and the stream may be fine
        with self._lock:
            stream = self._stream
            if stream is not None and stream.endpoint == failed:
                self._broken(stream, Unavailable(f"watch: calls failed over from {failed}"))

    def _schedule_probe(self) -> None:
        if self._probing or not self._watches:
            return
        self._probing = True
        self._timer.call_later(max(0.0, self._heard + PROBE_AFTER - time.monotonic()), self._probe)

    def _probe(self, asked: tuple[Stream, float] | None = None) -> None:
        # ``asked``: the stream a progress request went out on, and when; silent since, it moves.
        with self._lock:
            self._probing = False
            stream = self._stream
            if stream is None or not self._watches:
                return
            if asked is not None and asked[0] is stream and self._heard < asked[1]:
                silent = f"watch: {stream.endpoint} did not answer in {PROBE_TIMEOUT:g}s"
                self._broken(stream, Unavailable(silent))
                return
            now = time.monotonic()
            if now - self._heard < PROBE_AFTER:
                self._schedule_probe()
                return
            stream.send(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
            self._probing = True
        self._timer.call_later(PROBE_TIMEOUT, lambda: self._probe((stream, now)))


class LoopHub(_Hub):
    """The ``_Hub`` of one Client's watches on one event loop (``Watch(..., hub=)``, on the
    loop's thread only): the same decisions, on the loop's timers and a grpc.aio stream read
    by the loop. Opened only with the auth token at hand; without one it is a failed open,
    and the resume after it fetches one first (``Client.token_async``)."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(client, loop)
        self._loop = loop

    def _open(self) -> Stream:
        client = live(self._client_ref)
        if not client.token_at_hand():
            raise Unavailable("watch: no auth token at hand yet")
        return LoopStream(client, "watch", "Watch", self._on_item, client._token)

    def _resume(self, fetched: asyncio.Task[str | None] | None = None) -> None:
        # Once the auth token is at hand: fetching it (a stale one broke the stream) is no
        # failure. Fetched or not: without a token the open fails, counted, and backs off.
        client = self._client_ref()
        if fetched is None and client is not None and not client.token_at_hand():
            self._loop.create_task(client.token_async()).add_done_callback(self._resume)
            return
        if fetched is not None and not fetched.cancelled():
            fetched.exception()  # retrieved: the open reports what it means
        super()._resume()

    def _endpoint_failed(self, failed: Endpoint) -> None:
        # From whichever thread failed over (a threaded face's call may): on the loop.
        if running_loop() is self._loop:
            super()._endpoint_failed(failed)
        else:  # a loop that has ended has nothing to move
            call_soon(self._loop, super()._endpoint_failed, failed)


_hub_for: PerOwner[Client, _Hub] = PerOwner(_Hub)
