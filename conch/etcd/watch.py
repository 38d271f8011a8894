"""Watches: a key or range watched from a start revision, events delivered to a callback.

All the watches of one Client share one Watch.Watch stream (etcd serves many watchers on a
stream and tells them apart by watch_id), so a process with many waiters and holds pays for
one stream and one reader thread, not one of each per watch. etcd answers create requests
in the order it receives them, so the n-th ``created`` answer belongs to the n-th create
request still unanswered; later answers carry the watch_id it gave.
"""

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
from conch.etcd.stream import BidiStream, LoopStream, Stream, StreamItem
from conch.timer import LoopTimer, PerOwner, Scheduler, timer_for

PUT = kv_pb2.Event.PUT
DELETE = kv_pb2.Event.DELETE
# A member that hangs (stopped, swapping, cut off without closing connections) leaves a
# watch silent, and gRPC's own pings take long to give up on it. So a stream silent for
# PROBE_AFTER seconds asks etcd for a progress report (Watch.Watch progress_request, etcd
# 3.4+); no answer within PROBE_TIMEOUT seconds and the stream moves to the next endpoint.
PROBE_AFTER = 10.0
PROBE_TIMEOUT = 5.0
# Seconds the shared stream stays open with no watch on it: a waiter replaces its watch
# at every wake, and a new hold its waiting watch with its guard, each time for a moment
# with none open; re-opening the stream then would cost the handoff a stream set-up.
IDLE_CLOSE = 2.0


class WatchNotice(NamedTuple):
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
    given, from ``start_revision`` on (0: from now). Notices go to ``deliver`` from the
    client's stream reader thread, events in revision order (one etcd watcher); ``deliver``
    must not block (``cancel()`` waits for a notice being delivered). ``only_deletes`` asks
    etcd to filter out PUT events; ``confirm`` asks for a ``created`` notice once etcd has
    set the watch up. ``cancel()`` stops delivery. Raises EtcdError when the client's
    stream is not open and cannot be opened.

    When the shared stream breaks (a member goes away), stays silent through a progress
    request (a hung member, see ``probe_after``), or calls fail over away from its endpoint,
    every watch on it moves to the next endpoint and resumes just after the last revision
    it delivered, so no event is lost or repeated; only after ``MAX_RESUMES`` failed
    attempts in a row is the error delivered.
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
        hub: _Hub | None = None,
    ) -> None:
        self._confirm = confirm
        self._deliver = deliver
        self._filters = [rpc_pb2.WatchCreateRequest.NOPUT] if only_deletes else []
        self._key = key
        self._range_end = range_end
        self._next = start_revision  # first revision still owed; 0 until etcd says "now"
        self._probe_after = probe_after
        self._id: int | None = None  # etcd's watch_id on the current stream
        self._cancelled = False
        # Held while a notice is handed to ``deliver``, and by cancel(): once cancel()
        # returns, no notice is on its way any more. Reentrant: a ``deliver`` may cancel
        # its own watch.
        self._delivering = threading.RLock()
        self._ended = threading.Event()  # cancelled, or the error delivered
        self._hub = _hub_for(client) if hub is None else hub
        self._hub.add(self)

    def cancel(self) -> None:
        """Stop delivery and tell etcd to drop the watcher (Watch.Watch cancel_request).
        Nothing is delivered once this returns: a notice being delivered by another thread
        right now is waited for (``deliver`` must not block)."""
        with self._delivering:
            self._cancelled = True
        self._ended.set()
        self._hub.remove(self)

    def _hand_over(self, notice: WatchNotice) -> None:
        """Deliver ``notice`` unless cancelled (called with no hub lock held)."""
        with self._delivering:
            if not self._cancelled:
                self._deliver(notice)

    def _create_request(self) -> rpc_pb2.WatchRequest:
        return rpc_pb2.WatchRequest(
            create_request=rpc_pb2.WatchCreateRequest(
                key=self._key,
                range_end=self._range_end,
                start_revision=self._next,
                filters=self._filters,
            )
        )

    def _on_created(self, revision: int) -> WatchNotice | None:
        if self._next == 0:
            self._next = revision + 1  # "from now" is this revision on
        return WatchNotice(self, (), revision, created=True) if self._confirm else None

    def _on_events(self, response: rpc_pb2.WatchResponse) -> WatchNotice:
        self._next = response.events[-1].kv.mod_revision + 1
        return WatchNotice(self, list(response.events), response.header.revision)

    def _end(self, error: EtcdError) -> WatchNotice:
        self._ended.set()
        return WatchNotice(self, (), 0, error)


def _cancel_error(response: rpc_pb2.WatchResponse) -> EtcdError:
    if response.compact_revision:
        return Compacted(
            f"watch start revision compacted (oldest left {response.compact_revision})",
            response.compact_revision,
        )
    return EtcdError(f"watch cancelled by etcd: {response.cancel_reason}")


class _Hub:
    """The one Watch.Watch stream of a Client and the watches on it.

    State changes under ``_lock``, which is never held across a call that waits on etcd
    (opening the stream runs outside it). Notices are delivered outside it, from the reader
    thread (or, for the errors that end watches, the timer thread), so a ``deliver`` may
    cancel or open watches."""

    def __init__(self, client: Client) -> None:
        self._client_ref = weakref.ref(client)  # the hub lives in a map keyed by the client
        self._timer: Scheduler = timer_for(client)
        self._lock = threading.RLock()
        self._stream: Stream | None = None
        self._watches: set[Watch] = set()
        self._unanswered: collections.deque[Watch] = collections.deque()  # creates, in order
        self._by_id: dict[int, Watch] = {}
        self._heard = time.monotonic()  # when the current stream last answered
        self._failures = 0
        self._backoff = Backoff()
        self._resuming = False
        self._left: Endpoint | None = None  # the endpoint of the stream that broke
        self._probing = False
        self._idle_check = False
        self._opening = False  # a thread is opening the stream, outside the lock
        # The end of a stream that broke while it was being opened, before it was installed:
        # its reader starts with it, and an item for a stream not yet ours would be dropped.
        self._early_end: tuple[Stream, EtcdError] | None = None
        client.on_failover(self._endpoint_failed)

    # -- watches come and go -----------------------------------------------------------

    def add(self, watch: Watch) -> None:
        """Register ``watch``; open the stream first if there is none (in this thread,
        outside the lock). Raises EtcdError when that fails: ``watch`` is not registered."""
        with self._lock:
            self._watches.add(watch)
            if self._stream is not None:
                self._send_create(self._stream, watch)
                self._schedule_probe()
                return
            if self._resuming or self._opening:
                return  # created when that stream is up
            self._opening = True
        self._install(self._open_or_retry(watch))

    def remove(self, watch: Watch) -> None:
        with self._lock:
            if watch not in self._watches:
                return
            self._watches.discard(watch)
            stream = self._stream
            if watch._id is not None and stream is not None:
                self._by_id.pop(watch._id, None)
                stream.send(
                    rpc_pb2.WatchRequest(
                        cancel_request=rpc_pb2.WatchCancelRequest(watch_id=watch._id)
                    )
                )
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
            self._stream = None
            self._unanswered.clear()
            self._by_id.clear()
        stream.close()

    # -- the stream ----------------------------------------------------------------------

    def _open(self) -> Stream:
        """A new Watch.Watch stream. Never called with the lock held: it may need an
        Auth.Authenticate or a TLS handshake (seconds against a hung member), and the
        keepalive's failover and a hold's loss callback need the lock meanwhile."""
        client = self._client_ref()
        if client is None:
            raise EtcdError("client is closed", "CANCELLED")
        return BidiStream(client, "watch", "Watch", self._on_item)

    def _open_or_retry(self, withdraw: Watch | None) -> Stream:
        """``_open``, by the thread that set ``_opening``. When that fails: ``withdraw`` (the
        watch whose add failed, if any) is unregistered, the watches still registered (others
        came meanwhile) wait for a retry, and the EtcdError is raised."""
        try:
            return self._open()
        except EtcdError as exc:
            with self._lock:
                self._opening = False
                if withdraw is not None:
                    self._watches.discard(withdraw)
                if self._watches:
                    self._retry_open(exc)
            raise

    def _install(self, stream: Stream) -> None:
        """Make the newly opened ``stream`` the hub's and create every watch on it."""
        with self._lock:
            self._opening = False
            self._stream = stream
            self._heard = time.monotonic()
            self._unanswered.clear()
            self._by_id.clear()
            early, self._early_end = self._early_end, None
            if early is not None and early[0] is stream:
                # Broken before it was ours (etcd refused it, as while it restarts): resume
                # now, not when the probe finds the stream silent, seconds later.
                self._broken(stream, early[1])
                return
            for watch in list(self._watches):
                self._send_create(stream, watch)
            self._schedule_idle_check()  # every watch cancelled while it opened
            self._schedule_probe()

    def _retry_open(self, error: EtcdError) -> None:
        """Opening failed with watches waiting (lock held): try again after a pause, or end
        them all with the error."""
        self._failures += 1
        if not _resumable(error) or self._failures > Watch.MAX_RESUMES:
            self._end_all(error)
        else:
            self._resuming = True
            self._timer.call_later(self._backoff.next(), self._resume)

    def _send_create(self, stream: Stream, watch: Watch) -> None:
        watch._id = None
        self._unanswered.append(watch)
        stream.send(watch._create_request())

    def _on_item(self, item: StreamItem) -> None:
        """From the stream's reader thread: match the answer to its watch."""
        notices: list[WatchNotice] = []
        with self._lock:
            if item.stream is not self._stream:
                if self._opening and item.error is not None:
                    self._early_end = (item.stream, item.error)  # _install will see it
                return  # a stream we already left, or one not installed yet
            self._heard = time.monotonic()
            if item.error is not None:
                self._broken(item.stream, item.error)
                return
            response = item.response
            if response.created:
                watch = self._unanswered.popleft() if self._unanswered else None
                if watch is None:
                    return
                if response.canceled and item.stream.token and _refused(response.cancel_reason):
                    # etcd checks the stream's token when a watch is created and refuses a
                    # stale one (issued before an auth change, expired, unknown to a
                    # restarted member) by cancelling it, in 3.5 as "permission denied":
                    # the stream resumes with a fresh token; a real refusal is delivered
                    # after MAX_RESUMES attempts.
                    client = self._client_ref()
                    if client is not None:
                        client.invalidate_token(item.stream.token)
                    self._broken(item.stream, TokenInvalid(response.cancel_reason))
                    return
                if response.canceled:  # refused (permission denied, bad range)
                    self._watches.discard(watch)
                    if not watch._cancelled:
                        notices.append(watch._end(_cancel_error(response)))
                elif watch._cancelled or watch not in self._watches:
                    item.stream.send(
                        rpc_pb2.WatchRequest(
                            cancel_request=rpc_pb2.WatchCancelRequest(watch_id=response.watch_id)
                        )
                    )
                else:
                    self._failures = 0
                    self._backoff = Backoff()
                    watch._id = response.watch_id
                    self._by_id[response.watch_id] = watch
                    notice = watch._on_created(response.header.revision)
                    if notice is not None:
                        notices.append(notice)
            else:
                watch = self._by_id.get(response.watch_id)
                if watch is None or watch._cancelled:
                    return  # a progress report, or a watch cancelled meanwhile
                if response.canceled:
                    self._by_id.pop(response.watch_id, None)
                    self._watches.discard(watch)
                    notices.append(watch._end(_cancel_error(response)))
                elif response.events:
                    self._failures = 0
                    notices.append(watch._on_events(response))
        for notice in notices:
            notice.watch._hand_over(notice)

    def _broken(self, stream: Stream, error: EtcdError) -> None:
        """The stream failed (called with the lock held, with the stream current): move
        every watch to the next endpoint after a pause, or end them all with the error."""
        self._stream = None
        self._unanswered.clear()
        self._by_id.clear()
        stream.close()
        self._failures += 1
        if not _resumable(error) or self._failures > Watch.MAX_RESUMES:
            self._end_all(error)
            return
        # A stale token is no fault of the member: resume on the same one.
        self._left = stream.endpoint if isinstance(error, Unavailable) else None
        self._resuming = True
        self._timer.call_later(self._backoff.next(), self._resume)

    def _end_all(self, error: EtcdError) -> None:
        watches, self._watches = [w for w in self._watches if not w._cancelled], set()
        self._failures = 0
        self._backoff = Backoff()
        notices = [w._end(error) for w in watches]

        def deliver() -> None:
            for notice in notices:
                notice.watch._hand_over(notice)

        # Not under the lock, nor from inside a caller that holds it.
        self._timer.call_later(0, deliver)

    def _resume(self) -> None:
        """Re-open the stream on the next endpoint and re-create every watch from the
        revision it still owes."""
        client, left, self._left = self._client_ref(), self._left, None
        if client is not None and left is not None:
            client.failover(left)  # not under our lock: it calls failover listeners
        with self._lock:
            self._resuming = False
            if self._stream is not None or self._opening or not self._watches:
                return
            self._opening = True
        try:
            stream = self._open_or_retry(None)
        except EtcdError:
            return
        self._install(stream)

    def _endpoint_failed(self, failed: Endpoint) -> None:
        """Calls moved away from ``failed``: a stream on it moves too (a member that no
        longer answers calls likely leaves its watchers silent)."""
        client = self._client_ref()
        if client is None or client.endpoint == failed:
            return  # one endpoint only: nowhere to move, and the stream may be fine
        with self._lock:
            stream = self._stream
            if stream is None or stream.endpoint != failed:
                return
            self._broken(stream, Unavailable(f"watch: calls failed over from {failed}"))

    # -- the probe of a silent stream ----------------------------------------------------

    def _schedule_probe(self) -> None:
        if self._probing or not self._watches:
            return
        self._probing = True
        after = min(w._probe_after for w in self._watches)
        self._timer.call_later(max(0.0, self._heard + after - time.monotonic()), self._probe)

    def _probe(self) -> None:
        """Ask a silent stream for a progress report; if none comes, treat it as broken."""
        with self._lock:
            self._probing = False
            stream = self._stream
            if stream is None or not self._watches:
                return
            after = min(w._probe_after for w in self._watches)
            if time.monotonic() - self._heard < after:
                self._schedule_probe()
                return
            asked = time.monotonic()
            stream.send(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
            self._probing = True
        self._timer.call_later(PROBE_TIMEOUT, lambda: self._probe_answered(stream, asked))

    def _probe_answered(self, stream: Stream, asked: float) -> None:
        with self._lock:
            self._probing = False
            if stream is not self._stream:
                return
            if self._heard < asked:
                error = Unavailable(
                    f"watch: {stream.endpoint} did not answer in {PROBE_TIMEOUT:g}s"
                )
                self._broken(stream, error)
                return
            self._schedule_probe()


def _resumable(error: EtcdError) -> bool:
    """Errors a new stream may not meet: the member went away, or the token went stale
    (the new stream authenticates again)."""
    return isinstance(error, (Unavailable, TokenInvalid))


class LoopHub(_Hub):
    """The ``_Hub`` of one Client's watches opened on one event loop: the same decisions,
    run by the loop's timers, on a grpc.aio stream (``LoopStream``) read by the loop, so
    notices reach their watch on the loop's thread with no thread of ours handing them
    over (``Watch(..., hub=)``, on the loop's thread only). A stream is opened only with the
    auth token at hand; without one it is a failed open (retried after a backoff) while
    a task of the loop fetches the token (``Client.token_async``)."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(client)
        self._timer = LoopTimer(loop)
        self._loop = loop
        self._authenticating: asyncio.Task[str | None] | None = None

    def _open(self) -> Stream:
        client = self._client_ref()
        if client is None:
            raise EtcdError("client is closed", "CANCELLED")
        if not client.token_at_hand():
            if self._authenticating is None or self._authenticating.done():
                self._authenticating = self._loop.create_task(client.token_async())
            raise Unavailable("watch: no auth token at hand yet")
        return LoopStream(client, "watch", "Watch", self._on_item, client._token)

    def _resume(self) -> None:
        """As ``_Hub._resume``, once the auth token is at hand: fetching it (a stale one was
        what broke the stream, as under a burst of auth changes) is no failed open."""
        client = self._client_ref()
        if client is None or client.token_at_hand():
            super()._resume()
            return
        fetching = self._loop.create_task(client.token_async())
        fetching.add_done_callback(self._token_fetched)

    def _token_fetched(self, fetching: asyncio.Task[str | None]) -> None:
        # Fetched or not: without a token the open fails, counted, and backs off.
        if not fetching.cancelled():
            fetching.exception()  # retrieved: the open reports what it means
        super()._resume()

    def _endpoint_failed(self, failed: Endpoint) -> None:
        """From whichever thread failed over (a threaded face's call may): on the loop."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            super()._endpoint_failed(failed)
            return
        with contextlib.suppress(RuntimeError):  # the loop has ended: nothing to move
            self._loop.call_soon_threadsafe(super()._endpoint_failed, failed)


_hub_for: PerOwner[Client, _Hub] = PerOwner(_Hub)


def _refused(cancel_reason: str) -> bool:
    """Whether etcd cancelled a watch for its token or permissions."""
    return any(
        words in cancel_reason
        for words in ("permission denied", "auth token", "revision of auth store is old")
    )
