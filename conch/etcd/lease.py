"""Lease calls: LeaseGrant, LeaseRevoke, LeaseTimeToLive, and the LeaseKeepAlive stream."""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd.client import Backoff, Client, Endpoint
from conch.etcd.stream import BidiStream, LoopStream, Stream, StreamItem
from conch.flag import Flag

if TYPE_CHECKING:
    import asyncio

from conch.timer import Cancellable, LoopTimer, PerOwner, Scheduler, Timer


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

# What a keepalive comes to: the lease's TTL in seconds, or the EtcdError that ended it
# (LeaseNotFound for an answer with TTL <= 0, Unavailable for no answer in time).
Outcome = int | EtcdError


class KeepAlives:
    """The LeaseKeepAlive stream of one Client, for all of its leases.

    etcd takes keepalives for any number of leases on one stream and answers each with its
    lease ID, in the order it received them (as the Go client's lessor uses it), so a process
    with many sessions pays for one stream, its reader and one thread here, not one of each
    per lease. ``refresh(lease_id, deadline, done)`` sends one keepalive and calls
    ``done(outcome)`` exactly once (an ``Outcome``): the TTL etcd answered, LeaseNotFound
    when it answered TTL <= 0, Unavailable when no answer came by ``deadline``.

    Per keepalive, as for a lease on a stream of its own: a stream that breaks is dropped,
    the client fails over (``Client.on_failover`` listeners, e.g. the watch stream, follow)
    and the keepalive goes out again on the next stream after a capped backoff. A stream
    that is only silent is kept: after ASK_ANOTHER_AFTER the keepalive also goes to the next
    member, on a stream of its own, and whichever answers first counts (a late answer on a
    slow link is never thrown away for a new connection over that same link); when another
    member answered, its stream is the one in use from then on and the client fails over
    from the silent one. Each (stream, lease) counts the keepalives sent and the answers
    received: etcd answers them in order, so an answer that comes after a keepalive gave up
    on a stream belongs to that keepalive, and never confirms a later one.

    Threads: everything here runs on one timer thread (``timer``, named conch-keepalive),
    which makes no call that waits on etcd: it only queues requests and cancels calls.
    Opening a stream, which may need an Auth.Authenticate or a TLS handshake (seconds
    against a hung member), runs on a second thread (conch-keepalive-open), so one slow open
    never holds back another lease's deadline. ``done`` runs on the timer thread and must
    not block. A stream stays open while it is the one in use or a keepalive waits on it,
    and none stays open once no lease is kept alive here.
    """

    def __init__(self, client: Client) -> None:
        self._client_ref = weakref.ref(client)  # kept in a map keyed by the client
        self.timer = Timer("conch-keepalive")  # the threaded sessions' timers run here too
        self._steps: Scheduler = self.timer
        self._opener = Timer("conch-keepalive-open")
        # Touched only on the timer thread: no lock. First the stream in use, each with its
        # counts by lease ID.
        self._streams: dict[Stream, dict[int, _Counts]] = {}
        self._opening: dict[Endpoint, list[_Ask]] = {}  # streams being opened, who waits
        # Ends of streams that broke before they were registered: a stream's reader starts
        # with it, on the opener thread, and its end can reach the timer thread before the
        # stream itself does (a member that forgot our token refuses the stream at once).
        self._early_ends: dict[Stream, EtcdError] = {}
        self._asks: dict[int, _Ask] = {}  # the keepalive under way, by lease ID
        self._leases: set[int] = set()  # leases kept alive here
        # Answers from the streams' readers, not yet handled on the timer thread.
        self._inbox: collections.deque[StreamItem] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._draining = False

    # -- from any thread ------------------------------------------------------------------

    def refresh(self, lease_id: int, deadline: float, done: Callable[[Outcome], None]) -> None:
        """Send one LeaseKeepAliveRequest for ``lease_id`` and call ``done(outcome)`` once,
        from the timer thread, by ``deadline`` (a ``time.monotonic()`` value) at the latest.
        A keepalive still under way for the lease is given up (its ``done`` gets
        Unavailable). Raises RuntimeError when the timer thread cannot be started."""
        self._steps.call_later(0, lambda: self._start(_Ask(lease_id, deadline, done)))

    def forget(self, lease_id: int) -> None:
        """Stop keeping ``lease_id`` alive: a keepalive under way is dropped (its ``done``
        is not called) and its answers are ignored; the last lease closes the streams."""
        self._steps.call_later(0, lambda: self._forget(lease_id))

    # -- on the timer thread --------------------------------------------------------------

    def _start(self, ask: _Ask) -> None:
        previous = self._asks.get(ask.lease_id)
        if previous is not None:
            self._finish(previous, Unavailable("keepalive: given up for a newer one"))
        self._leases.add(ask.lease_id)
        self._asks[ask.lease_id] = ask
        left = ask.deadline - time.monotonic()
        ask.expiry = self._steps.call_later(left, lambda: self._expire(ask))
        self._ask(ask)

    def _ask(self, ask: _Ask) -> None:
        """Send ``ask``'s keepalive on the stream to ask next: the one in use, else one to
        the member after the last one asked (opened first if need be)."""
        if self._asks.get(ask.lease_id) is not ask or time.monotonic() >= ask.deadline:
            return
        target = self._next_to_ask(ask)
        if isinstance(target, (BidiStream, LoopStream)):
            self._send(ask, target)
        elif target is not None:
            self._open(target, ask)
        # None: every endpoint has it; any answer, or the deadline, settles it.

    def _next_to_ask(self, ask: _Ask) -> Stream | Endpoint | None:
        current = next(iter(self._streams), None)
        if not ask.asked and current is not None:
            return current
        client = self._client_ref()
        if client is None:
            return None
        endpoints = client.endpoints
        asked = {stream.endpoint for stream in ask.asked}
        if ask.asked:
            start = endpoints.index(list(ask.asked)[-1].endpoint) + 1
        else:
            start = endpoints.index(client.endpoint)
        for step in range(len(endpoints)):
            endpoint = endpoints[(start + step) % len(endpoints)]
            if endpoint in asked:
                continue
            for stream in self._streams:
                if stream.endpoint == endpoint:
                    return stream
            return endpoint
        return None

    def _send(self, ask: _Ask, stream: Stream) -> None:
        counts = self._streams[stream].setdefault(ask.lease_id, _Counts())
        ask.asked[stream] = counts.sent  # the index its answer will have
        counts.sent += 1
        stream.send(rpc_pb2.LeaseKeepAliveRequest(ID=ask.lease_id))
        client = self._client_ref()
        if client is None or len(client.endpoints) < 2:
            return  # no other member to ask: the answer, a broken stream or the deadline
        left = ask.deadline - time.monotonic()
        self._ask_again(ask, min(ASK_ANOTHER_AFTER, left / 2))

    def _ask_again(self, ask: _Ask, delay: float) -> None:
        if ask.next is not None:
            ask.next.cancel()
        ask.next = self._steps.call_later(delay, lambda: self._ask(ask))

    def _open(self, endpoint: Endpoint, ask: _Ask) -> None:
        waiting = self._opening.get(endpoint)
        if waiting is not None:
            if ask not in waiting:
                waiting.append(ask)
            return
        self._opening[endpoint] = [ask]
        timeout = max(0.001, ask.deadline - time.monotonic())
        try:
            self._start_dial(endpoint, timeout)
        except RuntimeError as exc:  # no thread to open it on: retried after a backoff
            self._opened(endpoint, Unavailable(f"cannot open a keepalive stream: {exc}"))

    def _opened(self, endpoint: Endpoint, opened: Stream | EtcdError) -> None:
        waiting = self._opening.pop(endpoint, [])
        if isinstance(opened, (BidiStream, LoopStream)) and opened in self._early_ends:
            # Ended before it was ours: a failed open, retried after a backoff. Kept, its
            # keepalives would go unanswered until the deadline declared the session lost.
            opened = self._early_ends.pop(opened)
        if isinstance(opened, (BidiStream, LoopStream)):
            if not self._leases:
                opened.close()
                return
            self._streams[opened] = {}
        for ask in waiting:
            if self._asks.get(ask.lease_id) is not ask:
                continue
            if isinstance(opened, (BidiStream, LoopStream)):
                self._send(ask, opened)
            else:
                ask.last_error = opened
                self._ask_again(ask, ask.backoff.next())

    def _on_item(self, item: StreamItem) -> None:
        counts = self._streams.get(item.stream)
        if counts is None:
            if item.error is not None and self._opening:
                self._early_ends[item.stream] = item.error  # for _opened to find
            return  # a stream we already left, or one not registered yet
        if item.error is not None:
            self._broken(item.stream, item.error)
            return
        lease_id = int(item.response.ID)
        lease_counts = counts.get(lease_id)
        if lease_counts is None:
            return  # a lease forgotten meanwhile
        index = lease_counts.received
        lease_counts.received += 1
        ask = self._asks.get(lease_id)
        if ask is None or index < ask.asked.get(item.stream, lease_counts.sent):
            return  # the late answer to an earlier keepalive
        self._settle_on(item.stream, ask)
        if item.response.TTL <= 0:
            self._finish(ask, LeaseNotFound(f"lease {lease_id:x} expired or was revoked"))
        else:
            self._finish(ask, int(item.response.TTL))

    def _broken(self, stream: Stream, error: EtcdError) -> None:
        """``stream`` ended: drop it, fail over, and send what waited on it again."""
        self._drop(stream)
        client = self._client_ref()
        if client is not None:
            client.failover(stream.endpoint)
        for ask in list(self._asks.values()):
            if stream in ask.asked:
                del ask.asked[stream]
                ask.last_error = error
                if not ask.asked:
                    self._ask_again(ask, ask.backoff.next())

    def _settle_on(self, answered: Stream, ask: _Ask) -> None:
        """The stream that answered is the one in use from now on. If the first one asked
        stayed silent, its member is at best slower than this one: calls and streams move
        away from it."""
        if next(iter(self._streams)) is not answered:
            self._streams = {answered: self._streams[answered], **self._streams}
        silent = next(iter(ask.asked))
        if silent is not answered:
            client = self._client_ref()
            if client is not None:
                client.failover(silent.endpoint)

    def _expire(self, ask: _Ask) -> None:
        if self._asks.get(ask.lease_id) is ask:
            self._finish(ask, Unavailable(f"keepalive: no answer in time ({ask.last_error})"))

    def _finish(self, ask: _Ask, outcome: Outcome) -> None:
        self._drop_ask(ask)
        ask.done(outcome)

    def _drop_ask(self, ask: _Ask) -> None:
        if self._asks.get(ask.lease_id) is ask:
            del self._asks[ask.lease_id]
        for handle in (ask.next, ask.expiry):
            if handle is not None:
                handle.cancel()
        self._close_unused()

    def _forget(self, lease_id: int) -> None:
        self._leases.discard(lease_id)
        for counts in self._streams.values():
            counts.pop(lease_id, None)
        ask = self._asks.get(lease_id)
        if ask is not None:
            self._drop_ask(ask)
        else:
            self._close_unused()

    def _close_unused(self) -> None:
        """Close every stream but the one in use that no keepalive waits on; all of them
        when no lease is left."""
        if len(self._streams) <= 1 and self._leases:
            return  # the usual case, at every answer: nothing to look through
        waited_on = {stream for ask in self._asks.values() for stream in ask.asked}
        for index, stream in enumerate(list(self._streams)):
            if stream not in waited_on and (index > 0 or not self._leases):
                self._drop(stream)

    def _drop(self, stream: Stream) -> None:
        self._streams.pop(stream, None)
        stream.close()

    # -- on other threads -----------------------------------------------------------------

    def _start_dial(self, endpoint: Endpoint, timeout: float) -> None:
        """Have ``_dial`` open a stream to ``endpoint`` on the opener thread. Raises
        RuntimeError when that thread cannot be started."""
        self._opener.call_later(0, lambda: self._dial(endpoint, timeout))

    def _dial(self, endpoint: Endpoint, timeout: float) -> None:
        """On the opener thread: open a stream to ``endpoint`` (Auth.Authenticate first when
        the token is missing, within ``timeout`` seconds), and hand it to the timer thread."""
        opened: BidiStream | EtcdError
        client = self._client_ref()
        try:
            if client is None:
                raise EtcdError("client is closed", "CANCELLED")
            opened = BidiStream(
                client, "lease", "LeaseKeepAlive", self._deliver, timeout, endpoint=endpoint
            )
        except EtcdError as exc:
            opened = exc
        except Exception as exc:  # e.g. gRPC refusing a closed channel: no stream, all the same
            opened = EtcdError(f"cannot open a LeaseKeepAlive stream to {endpoint}: {exc!r}")
        self._steps.call_later(0, lambda: self._opened(endpoint, opened))

    def _deliver(self, item: StreamItem) -> None:
        """From a stream's reader thread: hand the answer to the timer thread. Answers that
        come in a burst (keepalives sent together) are handled in one step."""
        with self._inbox_lock:
            self._inbox.append(item)
            if self._draining:
                return
            self._draining = True
        try:
            self._steps.call_later(0, self._drain)
        except RuntimeError:  # no thread for it now: the next answer tries again
            with self._inbox_lock:
                self._draining = False
            raise

    def _drain(self) -> None:
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    self._draining = False
                    return
                item = self._inbox.popleft()
            try:
                self._on_item(item)
            except Exception as exc:  # a bug (or a failover listener's) must not stop the rest
                log.error("keepalive-answer-failed", error=repr(exc))


class _Ask:
    """One keepalive of one lease under way: the streams it went out on (in order, each
    with the index its answer will have there), when it gives up, whom it tells."""

    __slots__ = ("asked", "backoff", "deadline", "done", "expiry", "last_error", "lease_id", "next")

    def __init__(self, lease_id: int, deadline: float, done: Callable[[Outcome], None]) -> None:
        self.lease_id = lease_id
        self.deadline = deadline
        self.done = done
        self.asked: dict[Stream, int] = {}
        self.backoff = Backoff()
        self.last_error: EtcdError = Unavailable("keepalive: no answer in time")
        self.next: Cancellable | None = None  # the next stream asked, or the retry
        self.expiry: Cancellable | None = None


class _Counts:
    """Keepalives of one lease sent on one stream, and answers received to them."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


class LoopKeepAlives(KeepAlives):
    """``KeepAlives`` on an event loop, for the coroutines of one loop: the same decisions,
    run by the loop's timers, on grpc.aio streams (``LoopStream``) read by the loop, so no
    thread of ours hands a keepalive or its answer over. ``refresh``, ``forget`` and
    ``done`` run on the loop's thread only; opening a stream is a task of the loop that
    awaits the auth token (``Client.token_async``), then waits for nothing."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(client)
        self._steps = LoopTimer(loop)
        self._loop = loop
        self._dialling: set[asyncio.Task[None]] = set()  # the loop keeps weak references

    def _start_dial(self, endpoint: Endpoint, timeout: float) -> None:
        task = self._loop.create_task(self._dial_on_loop(endpoint, timeout))
        self._dialling.add(task)
        task.add_done_callback(self._dialling.discard)

    async def _dial_on_loop(self, endpoint: Endpoint, timeout: float) -> None:
        opened: Stream | EtcdError
        client = self._client_ref()
        try:
            if client is None:
                raise EtcdError("client is closed", "CANCELLED")
            token = await client.token_async(timeout)
            opened = LoopStream(client, "lease", "LeaseKeepAlive", self._deliver, token, endpoint)
        except EtcdError as exc:
            opened = exc
        except Exception as exc:  # e.g. gRPC refusing a closed channel: no stream, all the same
            opened = EtcdError(f"cannot open a LeaseKeepAlive stream to {endpoint}: {exc!r}")
        self._opened(endpoint, opened)

    def refresh(self, lease_id: int, deadline: float, done: Callable[[Outcome], None]) -> None:
        self._start(_Ask(lease_id, deadline, done))  # on the loop already

    def forget(self, lease_id: int) -> None:
        """As ``KeepAlives.forget``, but a keepalive under way ends with Unavailable: its
        coroutine awaits no timer of its own."""
        ask = self._asks.get(lease_id)
        self._forget(lease_id)
        if ask is not None:
            ask.done(Unavailable("keepalive: the lease is no longer kept alive here"))

    def _deliver(self, item: StreamItem) -> None:  # on the loop: no hand-over
        self._on_item(item)


_keepalives: PerOwner[Client, KeepAlives] = PerOwner(KeepAlives)


def keepalives_for(client: Client) -> KeepAlives:
    """The one KeepAlives of ``client``, made on first use, gone with the client."""
    return _keepalives(client)


class KeepAlive:
    """The keepalives of one lease, waited for in the calling thread (on the client's one
    LeaseKeepAlive stream, as ``KeepAlives`` describes)."""

    # Beyond the keepalive's own deadline, which the timer thread enforces: how late that
    # thread may be scheduled before this thread stops waiting for it.
    _SLACK = 1.0  # seconds

    def __init__(self, client: Client, lease_id: int) -> None:
        self._keepalives = keepalives_for(client)
        self._lease_id = lease_id

    def refresh(self, deadline: float) -> int:
        """Return the lease's TTL in seconds after this keepalive (LeaseKeepAlive).

        Raises LeaseNotFound when etcd answers TTL <= 0 (expired or revoked), Unavailable when
        no answer comes by ``deadline`` (a ``time.monotonic()`` value)."""
        answers: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._keepalives.refresh(self._lease_id, deadline, answers.put)
        try:
            outcome = answers.get(timeout=max(0.0, deadline - time.monotonic()) + self._SLACK)
        except queue.Empty:
            raise Unavailable("keepalive: no answer in time") from None
        if isinstance(outcome, EtcdError):
            raise outcome
        return outcome

    def close(self) -> None:
        self._keepalives.forget(self._lease_id)
