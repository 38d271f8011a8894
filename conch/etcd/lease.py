"""Lease calls: LeaseGrant, LeaseRevoke, LeaseTimeToLive, and the LeaseKeepAlive stream."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.errors import EtcdError, LeaseNotFound, Unavailable
from conch.etcd.client import Backoff, Client, Endpoint
from conch.etcd.loop import spawn
from conch.etcd.stream import BidiStream, LoopStream, Stream, StreamItem
from conch.flag import Flag
from conch.timer import Cancellable, Handle, PerOwner, Scheduler, Timer


class Grant(NamedTuple):
    """A granted lease: ``id`` as etcd numbers it, ``ttl`` in whole seconds as etcd granted it."""

    id: int
    ttl: int


def grant(client: Client, ttl: int, interrupt: Flag | None = None) -> Grant:
    """Lease.LeaseGrant for ``ttl`` seconds (etcd may raise it to its minimum); ``interrupt``
    as in ``Client.call``."""
    request = rpc_pb2.LeaseGrantRequest(TTL=ttl)
    return granted(client.call("lease", "LeaseGrant", request, interrupt=interrupt))


def granted(response: rpc_pb2.LeaseGrantResponse) -> Grant:
    """The Grant in a LeaseGrantResponse; raises EtcdError when etcd refused it."""
    if response.error:
        raise EtcdError(f"lease grant refused: {response.error}")
    return Grant(response.ID, response.TTL)


def revoke(client: Client, lease_id: int, timeout: float | None = None) -> None:
    """Lease.LeaseRevoke: the lease and every key attached to it go at once; a lease that is
    already gone counts as revoked."""
    with contextlib.suppress(LeaseNotFound):
        client.call("lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout)


def time_to_live(client: Client, lease_id: int, timeout: float | None = None) -> int:
    """Lease.LeaseTimeToLive: seconds the lease has left; -1 when it is gone."""
    request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
    return int(client.call("lease", "LeaseTimeToLive", request, timeout).TTL)


# A keepalive unanswered this long (or half the time left) also goes to the next member,
# the first stream still listening: a slow link costs nothing, a silent member this much.
ASK_ANOTHER_AFTER = 0.5  # seconds
# How late the keepalives' timers may enforce a deadline before the waiter stops waiting.
KEEPALIVE_SLACK = 1.0  # seconds
NO_ANSWER = "keepalive: no answer in time"
_LEASE = ("lease", "LeaseKeepAlive")  # the stream: service, method

# What a keepalive comes to: the TTL in seconds, LeaseNotFound (TTL <= 0) or Unavailable.
Outcome = int | EtcdError


def wait_for(deadline: float) -> float:
    """Seconds to wait for the outcome of a keepalive due by ``deadline`` (monotonic)."""
    return max(0.0, deadline - time.monotonic()) + KEEPALIVE_SLACK


class KeepAlives:
    """The LeaseKeepAlive stream of one Client, for all of its leases (etcd answers each
    keepalive with its lease ID, in order). A broken stream is dropped, the client fails
    over, and the keepalive goes out again after a capped backoff; a silent one also goes to
    the next member after ASK_ANOTHER_AFTER, whose answer, if first, makes it the member in
    use. Steps run on one timer thread (``timer``, conch-keepalive) that never waits on etcd,
    streams open on another (conch-keepalive-open). No stream stays open once no lease is left."""

    def __init__(self, client: Client, steps: Scheduler | None = None) -> None:
        self._client_ref = weakref.ref(client)  # kept in a map keyed by the client
        self.timer = Timer("conch-keepalive")  # the threaded sessions' timers run here too
        self._steps: Scheduler = self.timer if steps is None else steps
        self._opener = Timer("conch-keepalive-open")
        # All on the timer thread: no lock. The stream in use first; per lease on each, the
        # keepalives sent and the answers received (etcd answers in order).
        self._streams: dict[Stream, dict[int, list[int]]] = {}
        self._opening: dict[Endpoint, list[_Ask]] = {}  # streams being opened, who waits
        self._asks: dict[int, _Ask] = {}  # the keepalive under way, by lease ID
        self._leases: set[int] = set()  # leases kept alive here
        # Answers from the readers, not yet handled on the timer thread.
        self._inbox: collections.deque[StreamItem] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._draining = False

    def refresh(self, lease_id: int, deadline: float, done: Callable[[Outcome], None]) -> None:
        """One LeaseKeepAliveRequest for ``lease_id``, from any thread; ``done(outcome)`` once,
        on the timer thread (it must not block), by ``deadline`` (``time.monotonic()``): the
        TTL, LeaseNotFound for TTL <= 0, Unavailable for no answer. One still under way for
        the lease is given up (Unavailable). Raises RuntimeError when no timer thread starts."""
        self._steps.call_later(0, lambda: self._start(_Ask(lease_id, deadline, done)))

    def forget(self, lease_id: int) -> None:
        """Stop keeping ``lease_id`` alive (from any thread): a keepalive under way is dropped
        (no ``done``); the last lease closes the streams."""
        self._steps.call_later(0, lambda: self._forget(lease_id))

    def _start(self, ask: _Ask) -> None:
        previous = self._asks.get(ask.lease_id)
        if previous is not None:
            self._finish(previous, Unavailable("keepalive: given up for a newer one"))
        self._leases.add(ask.lease_id)
        self._asks[ask.lease_id] = ask
        ask.expiry = self._steps.call_later(ask.left(), lambda: self._expire(ask))
        self._ask(ask)

    def _ask(self, ask: _Ask) -> None:
        # On the stream in use, else to the member after the last one asked.
        if self._asks.get(ask.lease_id) is not ask or ask.left() <= 0:
            return
        client = self._client_ref()
        if not ask.asked and self._streams:
            self._send(ask, next(iter(self._streams)))
        elif client is not None:
            asked = [stream.endpoint for stream in ask.asked]
            endpoints = client.endpoints
            start = endpoints.index(asked[-1]) + 1 if asked else endpoints.index(client.endpoint)
            for endpoint in [e for e in endpoints[start:] + endpoints[:start] if e not in asked]:
                stream = next((s for s in self._streams if s.endpoint == endpoint), None)
                if stream is None:
                    self._open(endpoint, ask)
                else:
                    self._send(ask, stream)
                return

    def _send(self, ask: _Ask, stream: Stream) -> None:
        counts = self._streams[stream].setdefault(ask.lease_id, [0, 0])
        ask.asked[stream] = counts[0]  # the index its answer will have
        counts[0] += 1
        stream.send(rpc_pb2.LeaseKeepAliveRequest(ID=ask.lease_id))
        if len(live(self._client_ref).endpoints) > 1:  # another member to ask
            self._ask_again(ask, min(ASK_ANOTHER_AFTER, ask.left() / 2))

    def _ask_again(self, ask: _Ask, delay: float) -> None:
        ask.next.cancel()
        ask.next = self._steps.call_later(delay, lambda: self._ask(ask))

    def _open(self, endpoint: Endpoint, ask: _Ask) -> None:
        waiting = self._opening.get(endpoint)
        if waiting is not None:
            if ask not in waiting:
                waiting.append(ask)
            return
        self._opening[endpoint] = [ask]
        try:
            self._start_dial(endpoint, max(0.001, ask.left()))
        except RuntimeError as exc:  # no thread to open it on: retried after a backoff
            self._opened(endpoint, Unavailable(f"cannot open a keepalive stream: {exc}"))

    def _opened(self, endpoint: Endpoint, opened: Stream | Exception) -> None:
        waiting = self._opening.pop(endpoint, [])
        if isinstance(opened, Stream) and opened.error is not None:
            # Refused at once (our token forgotten), before it was ours: a failed open (kept,
            # its keepalives would go unanswered until the deadline declared the session lost).
            opened.close()  # else gRPC's thread that takes its requests waits for one forever
            opened = opened.error
        if not isinstance(opened, Stream | EtcdError):  # e.g. gRPC refusing a closed channel
            opened = EtcdError(f"cannot open a LeaseKeepAlive stream to {endpoint}: {opened!r}")
        if isinstance(opened, Stream):
            if not self._leases:
                opened.close()
                return
            self._streams[opened] = {}
        for ask in [ask for ask in waiting if self._asks.get(ask.lease_id) is ask]:
            if isinstance(opened, Stream):
                self._send(ask, opened)
            else:  # retried after a backoff
                ask.last_error = opened
                self._ask_again(ask, ask.backoff.next())

    def _on_item(self, item: StreamItem) -> None:
        counts = self._streams.get(item.stream)
        if counts is None:
            return  # a stream we already left, or one not registered yet (``_opened``)
        if item.error is not None:
            self._drop(item.stream)
            live(self._client_ref).failover(item.stream.endpoint)
            for waiting in list(self._asks.values()):
                if waiting.asked.pop(item.stream, None) is not None:
                    waiting.last_error = item.error
                    if not waiting.asked:  # retried after a backoff
                        self._ask_again(waiting, waiting.backoff.next())
            return
        lease_id = int(item.response.ID)
        lease_counts = counts.get(lease_id)
        if lease_counts is None:
            return  # a lease forgotten meanwhile
        index = lease_counts[1]
        lease_counts[1] += 1
        ask = self._asks.get(lease_id)
        if ask is None or index < ask.asked.get(item.stream, lease_counts[0]):
            return  # the late answer to an earlier keepalive
        # The stream that answered is the one in use now; calls and streams move away from
        # a member that stayed silent (at best slower).
        if next(iter(self._streams)) is not item.stream:
            self._streams = {item.stream: counts, **self._streams}
        if next(iter(ask.asked)) is not item.stream:
            live(self._client_ref).failover(next(iter(ask.asked)).endpoint)
        if item.response.TTL <= 0:
            self._finish(ask, LeaseNotFound(f"lease {lease_id:x} expired or was revoked"))
        else:
            self._finish(ask, int(item.response.TTL))

    def _expire(self, ask: _Ask) -> None:
        if self._asks.get(ask.lease_id) is ask:
            self._finish(ask, Unavailable(f"{NO_ANSWER} ({ask.last_error})"))

    def _finish(self, ask: _Ask | None, outcome: Outcome | None = None) -> None:
        # Done with ``ask`` (``done(outcome)`` unless None); then close the streams unused.
        if ask is not None:
            if self._asks.get(ask.lease_id) is ask:
                del self._asks[ask.lease_id]
            ask.next.cancel()
            ask.expiry.cancel()
        # Every stream but the one in use that no keepalive waits on; all with no lease.
        if len(self._streams) > 1 or not self._leases:  # else (at every answer) none
            waited_on = {stream for other in self._asks.values() for stream in other.asked}
            for index, stream in enumerate(list(self._streams)):
                if stream not in waited_on and (index > 0 or not self._leases):
                    self._drop(stream)
        if ask is not None and outcome is not None:
            ask.done(outcome)

    def _forget(self, lease_id: int, outcome: Outcome | None = None) -> None:
        self._leases.discard(lease_id)
        for counts in self._streams.values():
            counts.pop(lease_id, None)
        self._finish(self._asks.get(lease_id), outcome)

    def _drop(self, stream: Stream) -> None:
        self._streams.pop(stream, None)
        stream.close()

    def _start_dial(self, endpoint: Endpoint, timeout: float) -> None:
        # On the opener thread (RuntimeError when it cannot be started): Auth.Authenticate
        # within ``timeout`` seconds if the token is missing; the stream to the timer thread.
        def dial() -> None:
            opened: Stream | Exception
            try:
                client = live(self._client_ref)
                token = client.token(timeout)
                opened = BidiStream(client, *_LEASE, self._deliver, token, endpoint)
            except Exception as exc:
                opened = exc
            self._steps.call_later(0, lambda: self._opened(endpoint, opened))

        self._opener.call_later(0, dial)

    def _deliver(self, item: StreamItem) -> None:
        # From a stream's reader: to the timer thread, a burst of answers in one step.
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


_UNANSWERED, _NONE_YET = Unavailable(NO_ANSWER), Handle(0.0, 0, None)  # shared by every _Ask


@dataclasses.dataclass(eq=False, slots=True)
class _Ask:
    """One keepalive under way: the streams it went out on (in order, each with the index
    its answer will have there), when it gives up, whom it tells."""

    lease_id: int
    deadline: float
    done: Callable[[Outcome], None]
    asked: dict[Stream, int] = dataclasses.field(default_factory=dict)
    backoff: Backoff = dataclasses.field(default_factory=Backoff)
    last_error: EtcdError = _UNANSWERED
    # The next stream asked, or the retry; when it gives up (none yet: a cancel does nothing).
    next: Cancellable = dataclasses.field(default_factory=lambda: _NONE_YET)
    expiry: Cancellable = dataclasses.field(default_factory=lambda: _NONE_YET)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def live(client_ref: weakref.ref[Client]) -> Client:
    """The client a stream is opened for (always there while one of its streams is: each
    holds it); raises EtcdError (CANCELLED) once it is gone."""
    client = client_ref()
    if client is None:
        raise EtcdError("client is closed", "CANCELLED")
    return client


class LoopKeepAlives(KeepAlives):
    """``KeepAlives`` for the coroutines of one loop: the same decisions, on the loop's
    timers and grpc.aio streams read by the loop. ``refresh``, ``forget`` and ``done`` run
    on the loop's thread only; a stream is opened by a task that awaits the auth token
    (``Client.token_async``), then waits for nothing."""

    def _start_dial(self, endpoint: Endpoint, timeout: float) -> None:
        async def dial() -> None:
            opened: Stream | Exception
            try:
                client = live(self._client_ref)
                token = await client.token_async(timeout)
                opened = LoopStream(client, *_LEASE, self._on_item, token, endpoint)
            except Exception as exc:
                opened = exc
            self._opened(endpoint, opened)

        spawn(asyncio.get_running_loop(), dial())

    def refresh(self, lease_id: int, deadline: float, done: Callable[[Outcome], None]) -> None:
        self._start(_Ask(lease_id, deadline, done))  # on the loop already

    def forget(self, lease_id: int) -> None:
        """As ``KeepAlives.forget``, but a keepalive under way ends with Unavailable (its
        session waits for no timer of its own)."""
        self._forget(lease_id, Unavailable("keepalive: the lease is no longer kept alive here"))


keepalives_for: PerOwner[Client, KeepAlives] = PerOwner(KeepAlives)
