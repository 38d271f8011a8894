"""conch for asyncio: the threaded API's shape, for coroutines (timeouts in seconds)::

    import conch.aio

    async with conch.aio.connect("10.0.0.1:2379") as client:
        sema = conch.aio.Semaphore(client, "reports", max=2, ttl=10)
        async with sema.acquire(timeout=30) as hold:   # raises conch.NoSlot after 30 s
            hold.revision      # fencing token: our key's create_revision
            hold.lease_id      # the session's lease
            hold.lost          # an asyncio.Event, set when the hold is lost
            await hold.check() # raises conch.HoldLost unless the hold is certainly ours
            await hold.put(key, value)   # a write that lands only while the slot is ours
            ...                # the critical section
        await conch.aio.who(client, "reports")   # [conch.Record, ...]

        async with conch.aio.Session(client, ttl=10) as session:  # one lease, several holds
            hold = await sema.acquire(timeout=30, session=session)

A native asyncio driver of the one recipe (``conch.recipe.Waiter``, the state machine the
threaded ``conch.Semaphore`` drives too): a coroutine feeds it etcd's answers and executes
its actions with awaits. Unary calls are gRPC futures handed to the loop
(``Client.call_async``); watches ride the client's one Watch stream and keepalives its one
LeaseKeepAlive stream, both shared with the threaded face (``conch.etcd.aio``); delays and
a hold's guard are the loop's timers, deciding as the threaded Hold does
(``recipe.guard_plan`` and the ``guard_on_*`` verdicts). So a waiting acquire costs no
thread, and the threads of a process stay a constant few whatever the number of waiters,
holds and sessions; nothing here uses the loop's default executor.

Cancelling a waiting acquire (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``)
feeds the machine an interrupt: it withdraws our key (a private session's lease revoked, a
shared session's key deleted), and the cancel propagates once that is over. If the slot was
granted just as the cancel came, the hold is released before it propagates. Either way no
key is left behind. A request already sent when the cancel comes is answered first (each
has the client's request timeout), so that no write lands after the withdrawal.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Callable, Coroutine, Generator, Sequence
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from conchpb.etcdserverpb import rpc_pb2

from conch import errors, keys, log, recipe
from conch.errors import EtcdError, HoldLost, LeaseNotFound
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import kv
from conch.etcd.client import Backoff, check_timeout
from conch.etcd.watch import WatchNotice
from conch.hold import WITHDRAW_TIMEOUT, warn_hold_dropped
from conch.identity import Identity
from conch.listing import Record, listing

# The threaded driver's readings of etcd's answers, shared so that the faces cannot differ.
from conch.semaphore import (
    _EVENT_TYPES,
    REENTRY_BACKOFF_CAP,
    _enqueue_answer,
    _failure,
    _key_rev,
    log_acquired,
    log_note,
    revision_to_count,
)
from conch.session import check_ttl, keepalive_margin, warn_session_dropped
from conch.timer import weakly

T = TypeVar("T")

__all__ = ["Client", "Hold", "Semaphore", "Session", "connect", "who"]


# Tasks started with nobody to await them (a guard step, a dropped object's release): the
# loop keeps only weak references to tasks, so they are kept here until done.
_background: set[asyncio.Task[Any]] = set()


def _spawn(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run ``coroutine`` as a task of its own on ``loop`` (the loop's thread only)."""
    task = loop.create_task(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _outlast_cancel(awaitable: asyncio.Future[T]) -> T:
    """Await ``awaitable`` (a task or future) to its end even if this task is cancelled
    meanwhile (what it does must not be cut short: a withdrawal, a release), then raise
    the CancelledError."""
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(awaitable)
        except asyncio.CancelledError as exc:
            if awaitable.done():
                if awaitable.cancelled():
                    raise
                result = awaitable.result()
            else:
                cancelled = exc
                continue
        if cancelled is not None:
            raise cancelled
        return result


# -- the client ---------------------------------------------------------------------------


class Client:
    """An etcd client for coroutines. ``sync`` is the ``conch.etcd.Client`` under it, whose
    channels, watch stream and endpoints both faces share (its blocking calls must not run
    on the loop). ``await client.close()`` (or leaving ``async with``) revokes the leases of
    the coroutine sessions still open on it (at most CLOSE_REVOKE_TIMEOUT seconds in all),
    then closes the channels."""

    def __init__(self, sync: etcd_client.Client) -> None:
        self.sync = sync
        self._keepers: set[_Keeper] = set()

    async def close(self) -> None:
        keepers, self._keepers = list(self._keepers), set()
        if keepers:
            timeout = etcd_client.CLOSE_REVOKE_TIMEOUT
            await asyncio.gather(*(k.close(timeout) for k in keepers), return_exceptions=True)
        self.sync.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class connect:  # a function to its callers: ``async with connect(...)``
    """``async with connect(endpoints, ...) as client`` (or ``client = await connect(...)``):
    a Client dialled within ``dial_timeout`` seconds, closed when the block ends. Arguments
    and errors as ``conch.connect`` (UsageError, Unavailable, AuthenticationFailed); the
    dial (Maintenance.Status, or Auth.Authenticate with credentials) is awaited, and a
    cancel ends it at once."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        dial_timeout: float = 5.0,
        request_timeout: float = 5.0,
        tls: etcd_client.TLS | None = None,
        credentials: etcd_client.Credentials | None = None,
    ) -> None:
        self._args = (endpoints, dial_timeout, request_timeout, tls, credentials)
        self._client: Client | None = None

    async def _connect(self) -> Client:
        endpoints, dial_timeout, request_timeout, tls, credentials = self._args
        parsed = etcd_client.parse_endpoints(endpoints)
        sync = await etcd_client.Client.connect_async(
            parsed, dial_timeout, request_timeout, tls, credentials
        )
        return Client(sync)

    def __await__(self) -> Generator[Any, None, Client]:
        return self._connect().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._connect()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


# -- the session --------------------------------------------------------------------------


class _Keeper:
    """A coroutine session's lease, its keepalive task and its loss: everything the task
    needs, and nothing that keeps the Session alive (a dropped Session is noticed)."""

    def __init__(self, client: Client, lease_id: int, ttl: int, alive_until: float) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.interval = ttl / 3
        self.alive_until = alive_until
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self.closed = False
        self.revoked: asyncio.Future[bool] | None = None
        self.listeners: dict[object, Callable[[str], None]] = {}
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self.run())
        client._keepers.add(self)

    async def run(self) -> None:
        client = self.client.sync
        margin = keepalive_margin(self.ttl)
        next_send = time.monotonic() + self.interval
        try:
            while True:
                await asyncio.sleep(max(0.0, next_send - time.monotonic()))
                sent = time.monotonic()
                deadline = sent + self.interval + margin
                try:
                    ttl = await etcd_aio.keepalive(client, self.lease_id, deadline)
                except LeaseNotFound:
                    self.declare_lost("lease expired or was revoked")
                    return
                except EtcdError as exc:
                    self.declare_lost(f"keepalive failed: {exc}")
                    return
                self.alive_until = sent + ttl
                next_send = sent + self.interval
        finally:
            # Closed, lost, or the loop ending (asyncio.run cancels what is left): the
            # client's keepalive stream no longer counts this lease among those it serves.
            etcd_aio.forget_lease(client, self.lease_id)

    def declare_lost(self, reason: str) -> None:
        if self.closed or self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        for key in list(self.listeners):
            listener = self.listeners.pop(key, None)
            if listener is not None:
                _run_callback(listener, reason)

    def add_listener(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(reason)`` on the loop once the session is lost (soon, if it is
        already); returns a function that removes it."""
        key = object()
        if self.lost.is_set():
            self.loop.call_soon(_run_callback, listener, self.reason or "")
        else:
            self.listeners[key] = listener

        def remove() -> None:
            self.listeners.pop(key, None)

        return remove

    def certainly_alive(self) -> bool:
        return not (self.lost.is_set() or self.closed) and time.monotonic() < self.alive_until

    async def close(self, timeout: float | None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke) within ``timeout``
        seconds; whether confirmed. A second close waits for the first one's revoke."""
        if self.revoked is None:
            self.closed = True
            self.task.cancel()
            etcd_aio.forget_lease(self.client.sync, self.lease_id)
            self.client._keepers.discard(self)
            self.revoked = self.loop.create_task(self._revoke(timeout))
        return await _outlast_cancel(self.revoked)

    async def _revoke(self, timeout: float | None) -> bool:
        try:
            await etcd_aio.revoke(self.client.sync, self.lease_id, timeout)
        except EtcdError as exc:
            log.warning("revoke-failed", lease=f"{self.lease_id:x}", error=str(exc))
            return False
        return True


def _run_callback(callback: Callable[[str], object], reason: str) -> None:
    try:
        callback(reason)
    except Exception as exc:  # one embedder's bug must not silence the others
        log.error("callback-failed", error=repr(exc))


def _session_dropped(keeper: _Keeper) -> None:
    """A Session was garbage-collected unclosed: warn, as Python does for an unclosed file,
    and revoke its lease on its loop (if the loop still runs; else it expires by its TTL)."""
    warn_session_dropped("conch.aio", keeper.lease_id)
    etcd_aio.call_soon(keeper.loop, lambda: _spawn(keeper.loop, keeper.close(None)))


class Session:
    """One etcd lease of ``ttl`` seconds (Lease.LeaseGrant), refreshed every TTL/3 by a task
    on the loop, on the client's one LeaseKeepAlive stream (shared with the threaded face's
    sessions); the coroutine face of ``conch.Session``. Open it with ``async with
    Session(client, ttl)`` or ``session = await Session(client, ttl)``; ``await
    session.close()`` revokes the lease, so every key on it goes at once.

    ``lost`` (an ``asyncio.Event``) is set the moment it is no longer certain the lease is
    alive: etcd answers TTL <= 0, the stream breaks and cannot be re-opened in time, or no
    answer comes within one interval plus ``keepalive_margin``; ``reason`` says which.
    ``alive_until`` is the ``time.monotonic()`` until which the lease is alive for sure (the
    last answered keepalive's send time + TTL). Raises UsageError for a bad ttl or client,
    Unavailable (or another EtcdError) when LeaseGrant fails.

    Share it between holds with ``sema.acquire(session=session)``: a hold on a shared
    session releases by deleting its own key, the session's loss loses every hold on it,
    and it holds at most one key per semaphore at a time (a second acquire of the same
    semaphore on it raises UsageError while the first waits or holds). A session dropped
    without ``close()`` is revoked when collected, with a ResourceWarning.
    """

    def __init__(self, client: Client, ttl: int = 10) -> None:
        if not isinstance(client, Client):
            raise errors.UsageError(
                f"bad client {client!r}: want a conch.aio.Client (conch.aio.connect(...))"
            )
        check_ttl(ttl)
        self.client = client
        self.ttl = ttl
        self._keeper: _Keeper | None = None
        self._claims: set[bytes] = set()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    async def _open(self, interrupt: asyncio.Event | None = None) -> Session:
        if self._keeper is not None:
            return self
        asked = time.monotonic()
        granted = await etcd_aio.grant(self.client.sync, self.ttl, interrupt=interrupt)
        # etcd restarts the countdown when it receives the grant, which is after we sent it:
        # so the lease is certainly alive until send time + TTL (monotonic).
        keeper = _Keeper(self.client, granted.id, granted.ttl, asked + granted.ttl)
        self._keeper = keeper
        self._finalizer = weakref.finalize(self, _session_dropped, keeper)
        self._finalizer.atexit = False  # at exit the lease simply expires after its TTL
        log.info("session", lease=f"{granted.id:x}", ttl=f"{granted.ttl}s")
        if granted.ttl != self.ttl:  # etcd's minimum TTL is 1.5 election timeouts
            log.warning("ttl-raised", asked=f"{self.ttl}s", granted=f"{granted.ttl}s", by="etcd")
        self.ttl = granted.ttl
        return self

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _kept(self) -> _Keeper:
        if self._keeper is None:
            raise errors.UsageError("session not open: await it or use async with")
        return self._keeper

    @property
    def lease_id(self) -> int:
        return self._kept.lease_id

    @property
    def interval(self) -> float:
        """Seconds between keepalives (TTL/3)."""
        return self._kept.interval

    @property
    def lost(self) -> asyncio.Event:
        return self._kept.lost

    @property
    def reason(self) -> str | None:
        """Why the session was lost; None while it is not."""
        return self._kept.reason

    @property
    def alive_until(self) -> float:
        """``time.monotonic()`` until which the lease is alive for sure."""
        return self._kept.alive_until

    def certainly_alive(self) -> bool:
        """Whether the lease is alive for sure now: not lost, not closed, and etcd's
        countdown from our last answered keepalive not run out."""
        return self._kept.certainly_alive()

    def _claim(self, key: bytes) -> None:
        if key in self._claims:
            raise errors.UsageError(
                f"session {self.lease_id:x} already waits for or holds {key.decode()!r}: "
                "one hold per semaphore per session; use another session"
            )
        self._claims.add(key)

    def _unclaim(self, key: bytes) -> None:
        self._claims.discard(key)

    async def close(self, timeout: float | None = None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke), waiting at most
        ``timeout`` seconds (default: the client's request timeout). Returns False when the
        revoke could not be confirmed (the lease then expires after its TTL). A cancel
        while it runs waits for the revoke to end, then propagates."""
        if self._keeper is None:
            return True
        if self._finalizer is not None:
            self._finalizer.detach()
        return await self._keeper.close(timeout)


# -- the hold -----------------------------------------------------------------------------


class Hold:
    """A slot held, for coroutines: ``revision`` is the fencing token (our key's
    create_revision), ``lease_id`` the session's lease, ``lost`` an ``asyncio.Event`` set
    when the session is lost or our key deleted (``reason`` says why). ``release()`` (or
    leaving ``async with``) gives the slot back: on a session of its own it revokes the
    lease, on a shared session it deletes our key (KV.Txn comparing its create_revision).
    Leaving the block after a loss raises HoldLost (unless the block is already raising);
    after an explicit ``release()`` inside it, it does not.

    Its guard (the watch on our key, the touch that moves the next waiter up, a look at the
    key after a broken watch) is a few short steps on the loop's timers, holding the Hold
    only weakly: a Hold dropped without release is released when collected, with a
    ResourceWarning."""

    def __init__(
        self,
        sema: Semaphore,
        session: Session,
        held: recipe.Held,
        retire: list[etcd_aio.LoopWatch],
        shared: bool,
    ) -> None:
        self.name = sema.name
        self.max = sema.max
        self.key = held.key
        self.revision = held.revision
        self.session = session
        self.lease_id = held.lease_id
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self._client = sema.client
        self._shared = shared
        self._loop = asyncio.get_running_loop()
        self._releasing = False
        self._released: asyncio.Future[bool] | None = None
        self._revoked_after_loss = False
        self._plan = recipe.guard_plan(held.touch)
        self._touch_value = held.value if held.touch != recipe.TouchOwed.NONE else None
        self._watches = retire  # the guard's: the waiting watch it retires, then its own
        self._held_at = held.held_at or held.revision
        self._watches_own_key = False  # the guard's own watch opened (or tried)
        self._backoff = Backoff()
        self._callbacks: list[Callable[[str], object]] = []
        self._forget_session = session._kept.add_listener(weakly(self._session_lost))
        self._finalizer = weakref.finalize(
            self, _hold_dropped, self._loop, session, self.key, self.revision, shared, retire
        )
        self._finalizer.atexit = False  # at exit the lease expires after its TTL
        self._start_guard()

    # -- loss --------------------------------------------------------------------------

    def _session_lost(self, reason: str) -> None:
        if not self._releasing:
            self._set_lost(f"session lost: {reason}")

    def _set_lost(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        log.warning("lost", name=self.name, rev=self.revision, reason=reason)
        _cancel_watches(self._watches)
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run_callback(callback, reason)

    def on_lost(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(reason)`` on the loop once the hold is lost (soon, if it already
        is). It must not block; its result is ignored."""
        if self.lost.is_set():
            self._loop.call_soon(_run_callback, callback, self.reason or "")
        else:
            self._callbacks.append(callback)

    async def check(self) -> None:
        """Raise HoldLost unless the hold is certainly ours now (``conch.Hold.check``: not
        released, the lease confirmed alive within the TTL on the monotonic clock, our key
        not seen deleted). Makes no etcd call."""
        self._check()

    def _check(self) -> None:
        if self.lost.is_set():
            raise HoldLost(f"hold of {self.name}[{self.max}] lost: {self.reason}")
        if self._releasing:
            raise HoldLost(f"hold of {self.name}[{self.max}] released")
        if not self.session.certainly_alive():
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: no keepalive confirmed within the TTL"
            )

    def expires_at(self) -> float:
        """The earliest instant, in ``time.monotonic()`` seconds, at which etcd can expire
        this hold's lease: the session's ``alive_until``, the send time of the last
        keepalive etcd answered plus the TTL (etcd restarts its countdown when it receives
        a keepalive, after we sent it). Later with every answered keepalive; 0.0, an instant
        long past, once the hold is lost or released. Makes no etcd call. As
        ``conch.Hold.expires_at``: bound each step of work by it with room to spare (a
        paused process stops its timers with it), and check again right before acting as
        the holder (``check()``)."""
        if self.lost.is_set() or self._releasing:
            return 0.0
        return self.session.alive_until

    @property
    def deadline(self) -> float:
        """``expires_at()``, as a property: an instant for ``asyncio.timeout_at``, once on
        the loop's clock (``loop.time()``; the default loop's is ``time.monotonic()``, but
        a loop may keep its own)::

            loop = asyncio.get_running_loop()
            async with asyncio.timeout_at(hold.deadline - time.monotonic() + loop.time()):
                await step()

        Read once, it is the expiry as known then; a keepalive moves it on
        (``timeout.reschedule`` to follow it)."""
        return self.expires_at()

    # -- guarded writes ----------------------------------------------------------------

    async def put(self, key: bytes | str, value: bytes | str, timeout: float | None = None) -> int:
        """Write ``key`` = ``value`` only while this hold is ours: one KV.Txn that compares
        our key's create_revision with ``revision`` (``conch.Hold.put``). The key is not
        bound to our lease. ``timeout`` in seconds (default: the client's request
        timeout). Returns the revision of the write. Raises HoldLost when the compare fails
        (``lost`` is set then, unless released), Unavailable or another EtcdError when etcd
        does not answer (the write may then have happened: read it back)."""
        return await self._guarded(kv.op_put(_bytes(key), _bytes(value)), timeout)

    async def delete(self, key: bytes | str, timeout: float | None = None) -> int:
        """Delete ``key`` only while this hold is ours (KV.Txn as in ``put``). Returns the
        revision of the deletion (also when the key was absent). Raises as ``put``."""
        return await self._guarded(kv.op_delete(_bytes(key)), timeout)

    async def _guarded(self, op: rpc_pb2.RequestOp, timeout: float | None) -> int:
        compare = [kv.create_revision_is(self.key, self.revision)]
        response = await etcd_aio.txn(self._client.sync, compare, [op], [], timeout)
        if not response.succeeded:
            if not self._releasing:
                self._set_lost("our key was deleted (found by a guarded write)")
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: our key (create_revision "
                f"{self.revision}) is gone; the guarded write was not made"
            )
        return int(response.header.revision)

    # -- the guard (loop timers; the Hold reached weakly) ------------------------------

    def _done(self) -> bool:
        return self._releasing or self.lost.is_set()

    def _later(self, delay: float, step: Callable[[], Any]) -> None:
        """Run the guard's ``step`` (a bound method; a coroutine function is run as a task)
        ``delay`` seconds from now, unless the Hold is gone or done by then."""
        method = weakref.WeakMethod(step)
        ref = weakref.ref(self)
        loop = self._loop

        def run() -> None:
            hold, bound = ref(), method()
            if hold is None or bound is None or hold._done():
                return
            result = bound()
            if asyncio.iscoroutine(result):
                _spawn(loop, result)

        loop.call_later(delay, run)

    def _start_guard(self) -> None:
        """The guard's schedule (``recipe.guard_plan``, as the threaded Hold's): the touch
        owed at once, the watch on our key a moment in, a later touch at max 1."""
        if self._plan.touch_at_once:
            # Another holder may leave any moment: the waiter behind us must be watching
            # for it, so it must learn now that it is in the window.
            self._later(0, self._touch_at_once)
        self._later(self._plan.watch_after, self._watch_own_key)

    async def _touch_at_once(self) -> None:
        touched = await self._touch(retry=self._touch_at_once)
        if touched is not None and not self._watches_own_key:
            self._held_at = max(self._held_at, touched)  # ours at the touch: nothing before

    async def _touch_due(self) -> None:
        await self._touch(retry=self._touch_due)

    async def _watch_own_key(self) -> None:
        touch_after = self._plan.touch_after
        if touch_after is not None:
            self._later(touch_after - self._plan.watch_after, self._touch_due)
        self._watches_own_key = True
        await self._open_watch(self._held_at + 1)

    async def _open_watch(self, start: int) -> None:
        _cancel_watches(self._watches)
        try:
            watch = await etcd_aio.LoopWatch.open(
                self._client.sync, weakly(self._on_notice), self.key, start, only_deletes=True
            )
        except EtcdError:
            self._later(self._backoff.next(), self._look_at_key)
            return
        self._watches.append(watch)
        if self._done():  # released or lost while it opened
            _cancel_watches(self._watches)

    def _on_notice(self, notice: WatchNotice) -> None:
        """On the loop: our key deleted, or the watch ended."""
        verdict = recipe.guard_on_notice(self._done(), ended=notice.error is not None)
        if verdict == recipe.GuardVerdict.LOST:
            self._set_lost("our key was deleted (lease revoked or expired, or by hand)")
        elif verdict == recipe.GuardVerdict.LOOK:
            self._later(self._backoff.next(), self._look_at_key)

    async def _look_at_key(self) -> None:
        try:
            response = await etcd_aio.range_(self._client.sync, rpc_pb2.RangeRequest(key=self.key))
        except EtcdError:
            self._later(self._backoff.next(), self._look_at_key)
            return
        found = response.kvs[0] if response.kvs else None
        seen = None if found is None else recipe.KeyRev(found.key, found.create_revision, 0)
        # Only a release makes the deletion no loss (a loss seen first is kept as it is).
        verdict = recipe.guard_on_look(self._releasing, seen, self.revision)
        if verdict == recipe.GuardVerdict.LOST:
            self._set_lost("our key was deleted")
        elif verdict == recipe.GuardVerdict.WATCH:
            await self._open_watch(response.header.revision + 1)

    async def _touch(self, retry: Callable[[], Any]) -> int | None:
        """Re-put our key if it is still ours (KV.Txn, compare on create_revision): wakes
        the waiter behind us. Retried with backoff while etcd is away or refuses writes;
        the touch's revision, or None (done, lost, or a retry scheduled)."""
        assert self._touch_value is not None
        response = None
        try:
            response = await _touch(
                self._client.sync, self.key, self.revision, self._touch_value, self.lease_id
            )
        except EtcdError as exc:
            # etcd away, or refusing writes (its space alarm): the hold is not lost for that.
            log.warning("touch-failed", name=self.name, error=str(exc))
        succeeded = None if response is None else bool(response.succeeded)
        verdict = recipe.guard_on_touch(self._releasing, succeeded)
        if verdict == recipe.GuardVerdict.RETRY:
            self._later(self._backoff.next(), retry)
        elif verdict == recipe.GuardVerdict.LOST:
            self._set_lost("our key was deleted (lease revoked or expired, or by hand)")
        elif verdict == recipe.GuardVerdict.WATCH and response is not None:
            return int(response.header.revision)
        return None

    # -- release -----------------------------------------------------------------------

    async def release(self) -> None:
        """Give the slot back (``conch.Hold.release``): on a session of its own, revoke the
        lease (Lease.LeaseRevoke), which deletes our key with it in one revision; on a
        shared session, delete our key (KV.Txn comparing its create_revision). Best
        effort: on failure the lease expires after its TTL; after a loss it is tried for at
        most WITHDRAW_TIMEOUT seconds. Idempotent: a second call waits for the first. A
        cancel while it runs waits for it to end, then propagates. Logs ``released``."""
        if self._released is None:
            self._releasing = True
            self._finalizer.detach()
            self._revoked_after_loss = self.lost.is_set()
            self._released = self._loop.create_task(self._give_back())
        await _outlast_cancel(self._released)

    async def _give_back(self) -> bool:
        timeout = WITHDRAW_TIMEOUT if self._revoked_after_loss else None
        try:
            revoked = await _give_back(
                self.session, self._client.sync, self.key, self.revision, self._shared, timeout
            )
        finally:
            # The watches go only after the revoke: it is what the next holder waits for.
            _cancel_watches(self._watches)
            self._forget_session()
        extra = {"after": "loss"} if self._revoked_after_loss else {}
        log.info("released", name=self.name, rev=self.revision, **extra, revoked=revoked)
        return revoked

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release; then raise HoldLost if the hold was lost before the block ended (as
        ``check()`` judges it then), unless the block is already raising or released the
        hold itself before any loss."""
        loss: HoldLost | None = None
        was_released = self._releasing
        try:
            self._check()
        except HoldLost as lost:
            loss = None if was_released and not self._revoked_after_loss else lost
        await self.release()
        if loss is not None and exc is None:
            raise loss


def _bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else text


def _cancel_watches(watches: list[etcd_aio.LoopWatch]) -> None:
    while watches:
        watches.pop().cancel()


async def _touch(
    client: etcd_client.Client,
    key: bytes,
    revision: int,
    value: bytes,
    lease_id: int,
    interrupt: asyncio.Event | None = None,
) -> rpc_pb2.TxnResponse:
    """``hold.touch``, awaited: re-put ``key`` on ``lease_id`` if its create_revision is
    still ``revision`` (one KV.Txn; ``succeeded`` false when the key is gone)."""
    compare = [kv.create_revision_is(key, revision)]
    return await etcd_aio.txn(
        client, compare, [kv.op_put(key, value, lease_id)], [], None, interrupt
    )


async def _give_back(
    session: Session,
    client: etcd_client.Client,
    key: bytes,
    revision: int,
    shared: bool,
    timeout: float | None,
) -> bool:
    """Revoke a private session, or delete our key from a shared one; whether confirmed."""
    if not shared:
        return await session.close(timeout)
    try:
        await etcd_aio.delete_own_key(client, key, revision, timeout)
    except EtcdError as exc:
        log.warning("delete-failed", key=key.decode(errors="replace"), error=str(exc))
        return False
    finally:
        session._unclaim(key)
    return True


def _hold_dropped(
    loop: asyncio.AbstractEventLoop,
    session: Session,
    key: bytes,
    revision: int,
    shared: bool,
    watches: list[etcd_aio.LoopWatch],
) -> None:
    """A Hold was garbage-collected unreleased: warn, and release it on its loop."""
    warn_hold_dropped("conch.aio", key, revision)

    def give_back() -> None:
        _cancel_watches(watches)
        _spawn(loop, _give_back(session, session.client.sync, key, revision, shared, None))

    etcd_aio.call_soon(loop, give_back)


# -- the driver of the recipe -------------------------------------------------------------


class _Lost(NamedTuple):
    """A session's loss, as queued: fed to the machine only if it is the current session."""

    lease_id: int
    reason: str


class _Driver:
    """Runs one ``recipe.Waiter`` from a coroutine: executes its actions with awaits
    (unary calls one after another, in the order given), and feeds it their answers and
    the inputs that arrive on the loop (watch notices, a session's loss, the deadline, the
    end of a pause, an interrupt) through one asyncio queue."""

    def __init__(self, sema: Semaphore, timeout: float | None, session: Session | None) -> None:
        self.sema = sema
        self.client = sema.client.sync
        self.loop = asyncio.get_running_loop()
        self.inputs: asyncio.Queue[recipe.Input | _Lost] = asyncio.Queue()
        self.interrupted = asyncio.Event()
        self.shared = session
        self.sessions: dict[int, Session] = {}  # private sessions opened, by lease
        self.current_lease = session.lease_id if session is not None else 0
        self.watches: dict[int, etcd_aio.LoopWatch] = {}
        self.timers: list[asyncio.TimerHandle] = []
        self.forget: list[Callable[[], None]] = []
        self.started = time.monotonic()
        self.timeout = timeout
        if session is None:
            self.waiter = recipe.Waiter(sema.prefix, sema.max, _pauses())
        else:
            key = sema._key(session.lease_id)
            self.waiter = recipe.Waiter(sema.prefix, sema.max, _pauses(), key, session.lease_id)

    def interrupt(self) -> None:
        """From the awaiting coroutine's cancel: stop waiting (the machine withdraws)."""
        self.interrupted.set()  # ends the retries of a call under way
        self.inputs.put_nowait(recipe.Interrupt("cancelled"))

    async def run(self) -> recipe.Outcome:
        waiter = self.waiter
        todo = collections.deque(waiter.start())
        if self.timeout is not None:
            if self.timeout == 0:
                todo.extend(waiter.feed(recipe.DeadlineReached()))  # try once, do not wait
            else:
                at = self.loop.time() + self.timeout
                put = self.inputs.put_nowait
                self.timers.append(self.loop.call_at(at, put, recipe.DeadlineReached()))
        if self.shared is not None:
            self._subscribe(self.shared)
        answer: recipe.Input | _Lost | None
        try:
            while waiter.outcome is None or todo:
                # What arrived meanwhile goes in first: a loss or an interrupt ends a wait
                # before its next request, an event is never left behind a slow call.
                while not self.inputs.empty():
                    todo.extend(self._feed(self.inputs.get_nowait()))
                if todo:
                    answer = await self._execute(todo.popleft())
                elif waiter.outcome is None:
                    answer = await self.inputs.get()
                else:
                    break
                if answer is not None:
                    todo.extend(self._feed(answer))
            assert waiter.outcome is not None
            return waiter.outcome
        finally:
            for timer in self.timers:
                timer.cancel()
            for forget in self.forget:
                forget()
            outcome = waiter.outcome
            held = outcome if isinstance(outcome, recipe.Held) else None
            keep = set(held.retire) if held is not None else set()
            for watch_id in [w for w in self.watches if w not in keep]:
                self.watches.pop(watch_id).cancel()
            # The machine closes every private session it leaves; after a failure of our
            # own (a bug, the loop shutting down), none may be left kept alive.
            left = [
                s for lease, s in self.sessions.items() if held is None or lease != held.lease_id
            ]
            for session in left:
                self.sessions.pop(session.lease_id)
            if left:
                await asyncio.gather(
                    *(s.close(WITHDRAW_TIMEOUT) for s in left), return_exceptions=True
                )

    def _feed(self, item: recipe.Input | _Lost) -> list[recipe.Action]:
        if isinstance(item, _Lost):
            if item.lease_id != self.current_lease:
                return []  # a session we left
            return self.waiter.feed(recipe.SessionLost(item.reason))
        return self.waiter.feed(item)

    def _subscribe(self, session: Session) -> None:
        lease_id = session.lease_id
        put = self.inputs.put_nowait
        self.forget.append(session._kept.add_listener(lambda reason: put(_Lost(lease_id, reason))))

    async def _execute(self, action: recipe.Action) -> recipe.Input | None:
        """Do ``action``; its answer (None: it has none, or arrives later on the queue)."""
        if isinstance(action, recipe.Note):
            await self._log(action)
            return None
        if isinstance(action, recipe.CancelWatch):
            watch = self.watches.pop(action.id, None)
            if watch is not None:
                watch.cancel()
            return None
        if isinstance(action, recipe.Pause):
            put = self.inputs.put_nowait
            self.timers.append(
                self.loop.call_later(action.seconds, put, recipe.PauseOver(action.id))
            )
            return None
        if isinstance(action, recipe.OpenWatch):
            return await self._open_watch(action)
        try:
            return await self._call(action)
        except errors.Interrupted:
            return None  # the interrupt, already queued, is fed next
        except EtcdError as exc:
            return recipe.Failed(action.id, _failure(exc), str(exc), exc)

    async def _call(self, action: recipe.Action) -> recipe.Input:
        sema, client = self.sema, self.client
        if isinstance(action, recipe.OpenSession):
            session = await Session(sema.client, sema.ttl)._open(self.interrupted)
            self.sessions[session.lease_id] = session
            self.current_lease = session.lease_id
            self._subscribe(session)
            return recipe.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, recipe.SendEnqueue):
            value, response = await sema._enqueue(action, self.interrupted)
            return _enqueue_answer(action, response, value)
        if isinstance(action, recipe.ReadStanding):
            return await sema._read_standing(action, self.interrupted)
        if isinstance(action, recipe.ReadKeys):
            reads = [kv.op_get(key) for key in action.keys]
            response = await etcd_aio.txn(client, [], reads, [], interrupt=self.interrupted)
            found = [r.response_range.kvs for r in response.responses]
            kvs = [_key_rev(k[0]) if k else None for k in found]
            return recipe.KeysAnswer(action.id, int(response.header.revision), kvs)
        if isinstance(action, recipe.Touch):
            touched = await _touch(
                client, action.key, action.revision, action.value, action.lease_id, self.interrupted
            )
            return recipe.TouchAnswer(
                action.id, int(touched.header.revision), bool(touched.succeeded)
            )
        if isinstance(action, recipe.CheckLease):
            if self.shared is not None and not self.shared.certainly_alive():
                return recipe.LeaseAnswer(action.id, 0)
            ttl = await etcd_aio.time_to_live(
                client, action.lease_id, WITHDRAW_TIMEOUT, self.interrupted
            )
            return recipe.LeaseAnswer(action.id, ttl)
        if isinstance(action, recipe.Withdraw):
            await self._withdraw(action)
            return recipe.Withdrawn(action.id)
        raise AssertionError(f"unknown action {action!r}")

    async def _open_watch(self, action: recipe.OpenWatch) -> recipe.Input | None:
        watch_id = action.id
        put = self.inputs.put_nowait

        def on_notice(notice: WatchNotice) -> None:  # on the loop
            put(_watch_input(watch_id, notice))

        end = kv.prefix_end(action.key) if action.prefix else b""
        try:
            watch = await etcd_aio.LoopWatch.open(
                self.client, on_notice, action.key, 0, end, only_deletes=action.prefix, confirm=True
            )
        except EtcdError as exc:
            return recipe.Failed(watch_id, _failure(exc), str(exc), exc)
        self.watches[watch_id] = watch
        return None

    async def _withdraw(self, action: recipe.Withdraw) -> None:
        """Take our key out of the queue, best effort within WITHDRAW_TIMEOUT: a private
        session revoked, else our key deleted (by its create_revision, or, when our
        enqueue's outcome is unknown, if it is on our lease)."""
        if action.revoke:
            session = self.sessions.pop(action.lease_id, None)
            if session is not None:
                await session.close(WITHDRAW_TIMEOUT)
            return
        try:
            if action.revision:
                await etcd_aio.delete_own_key(
                    self.client, action.key, action.revision, WITHDRAW_TIMEOUT
                )
                return
            on_our_lease = rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.LEASE,
                key=action.key,
                lease=action.lease_id,
            )
            await etcd_aio.txn(
                self.client, [on_our_lease], [kv.op_delete(action.key)], [], WITHDRAW_TIMEOUT
            )
        except EtcdError as exc:
            log.warning("withdraw-failed", name=self.sema.name, error=str(exc))

    async def _log(self, note: recipe.Note) -> None:
        """A Note as the log line the threaded face writes for it."""
        sema = self.sema
        revision = revision_to_count(note)
        ahead = None if revision is None else await self._count_ahead(revision)
        log_note(sema.name, sema.max, sema.identity.host, note, ahead)

    async def _count_ahead(self, revision: int) -> int | None:
        """How many keys are ahead of ours, for the ``queued`` line only (None if etcd does
        not say): etcd's count ignores the create_revision filter, so this reads them."""
        request = kv.prefix_request(
            self.sema.prefix, keys_only=True, max_create_revision=revision - 1
        )
        try:
            return len((await etcd_aio.range_(self.client, request)).kvs)
        except EtcdError:
            return None

    def raise_for(self, outcome: recipe.GaveUp) -> None:
        """Raise what ``outcome`` means to the caller (as ``conch.Semaphore.acquire``)."""
        sema = self.sema
        if outcome.reason == recipe.Reason.NO_SLOT:
            raise errors.NoSlot(
                f"no free slot of {sema.name}[{sema.max}] in time ({outcome.detail})"
            )
        if outcome.reason == recipe.Reason.INTERRUPTED:
            raise errors.Interrupted(outcome.detail)
        if outcome.reason == recipe.Reason.SESSION_LOST:
            raise errors.SessionLost(outcome.detail)
        failed = outcome.cause
        if isinstance(failed, recipe.Failed) and isinstance(failed.cause, BaseException):
            raise failed.cause  # etcd unreachable at the first session (69), or refused
        raise EtcdError(outcome.detail)


def _pauses() -> Backoff:
    """The machine's pauses (before re-entering, reading again): as the threaded face's."""
    return Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)


def _watch_input(watch_id: int, notice: WatchNotice) -> recipe.Input:
    """A notice of watch ``watch_id`` as the machine's input."""
    if notice.error is not None:
        compacted = isinstance(notice.error, errors.Compacted)
        return recipe.WatchBroken(watch_id, compacted, str(notice.error))
    if notice.created:
        return recipe.WatchCreated(watch_id, notice.revision)
    events = [recipe.Event(_EVENT_TYPES[e.type], _key_rev(e.kv)) for e in notice.events]
    return recipe.WatchEvents(watch_id, events, notice.revision)


# -- the semaphore ------------------------------------------------------------------------


class _Acquiring:
    """What ``Semaphore.acquire`` returns: ``async with`` it, or ``await`` it for a Hold to
    release yourself."""

    def __init__(self, sema: Semaphore, timeout: float | None, session: Session | None) -> None:
        self._sema = sema
        self._timeout = timeout
        self._session = session
        self._hold: Hold | None = None

    async def _acquire(self) -> Hold:
        sema, session = self._sema, self._session
        if self._timeout is not None:
            check_timeout("timeout", self._timeout, zero=True)
        if session is not None:
            if session.client is not sema.client:
                raise errors.UsageError("session: belongs to another client than the semaphore")
            key = sema._key(session.lease_id)
            session._claim(key)
        driver = _Driver(sema, self._timeout, session)
        loop = asyncio.get_running_loop()
        driving = loop.create_task(driver.run())
        try:
            outcome = await asyncio.shield(driving)
        except asyncio.CancelledError:
            # Withdraw our key before the cancel propagates; a slot granted just now is
            # released. A second cancel does not cut that short.
            driver.interrupt()
            await _outlast_cancel(loop.create_task(_release_if_granted(sema, driver, driving)))
            raise
        except BaseException:
            if session is not None:
                session._unclaim(key)
            raise
        return sema._hold_from(driver, outcome)

    def __await__(self) -> Generator[Any, None, Hold]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Hold:
        self._hold = await self._acquire()
        return self._hold

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hold is not None
        await self._hold.__aexit__(exc_type, exc, traceback)


async def _release_if_granted(
    sema: Semaphore, driver: _Driver, driving: asyncio.Task[recipe.Outcome]
) -> None:
    """After an interrupted wait: release the hold if it came all the same. Run as a task of
    its own, so a second cancel cannot stop it between the grant and the release."""
    try:
        outcome = await driving
        hold = sema._hold_from(driver, outcome)
    except errors.ConchError:  # Interrupted, NoSlot...: no key left
        if driver.shared is not None:
            driver.shared._unclaim(sema._key(driver.shared.lease_id))
        return
    await hold.release()


class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``, for coroutines: arguments and
    UsageError as ``conch.Semaphore`` (checked here, no etcd call)."""

    def __init__(
        self,
        client: Client,
        name: str,
        max: int,
        ttl: int = 10,
        spread: bool = False,
        identity: Identity | None = None,
    ) -> None:
        if not isinstance(client, Client):
            raise errors.UsageError(
                f"bad client {client!r}: want a conch.aio.Client (conch.aio.connect(...))"
            )
        keys.check_name(name)
        self.identity = identity or Identity.current()
        keys.check_host(self.identity.host)
        keys.check_max(max)
        check_ttl(ttl)
        self.client = client
        self.name = name
        self.max = max
        self.ttl = ttl
        self.spread = spread
        self.prefix = keys.sema_prefix(name, max)

    def acquire(self, timeout: float | None = None, session: Session | None = None) -> _Acquiring:
        """``async with sema.acquire(timeout) as hold`` (or ``hold = await ...``): wait for a
        slot (``conch.Semaphore.acquire``, the same recipe). ``timeout`` in seconds: None
        waits as long as it takes, 0 tries once. Raises NoSlot when time runs out,
        Unavailable when no session can be established, UsageError for a bad timeout.
        ``session``: a ``conch.aio.Session`` of this client to hold the slot on (a loss
        while queued raises SessionLost). Cancelling the waiting task withdraws our key (or
        releases a slot granted meanwhile) before the CancelledError leaves it."""
        return _Acquiring(self, timeout, session)

    def _key(self, lease_id: int) -> bytes:
        if self.spread:
            return keys.spread_key(self.name, self.max, self.identity.host)
        return keys.holder_key(self.name, self.max, lease_id)

    def _hold_from(self, driver: _Driver, outcome: recipe.Outcome) -> Hold:
        if isinstance(outcome, recipe.GaveUp):
            driver.raise_for(outcome)
        assert isinstance(outcome, recipe.Held)
        shared = driver.shared is not None
        session = driver.shared or driver.sessions.pop(outcome.lease_id)
        retire = [driver.watches.pop(w) for w in outcome.retire if w in driver.watches]
        log_acquired(self.name, self.max, outcome, driver.started)
        return Hold(self, session, outcome, retire, shared)

    async def _enqueue(
        self, action: recipe.SendEnqueue, interrupt: asyncio.Event
    ) -> tuple[bytes, kv.TxnResponse]:
        """Step 1: put our key bound to the lease, create-if-absent, and read the first
        ``max`` keys in the same KV.Txn (else read the key found in our place), as
        ``conch.Semaphore`` does. Returns the value we sent and the response."""
        value = self.identity.entering().to_json()
        key = action.key
        heads = kv.prefix_request(
            self.prefix, limit=self.max, keys_only=True, sort_target=kv.CREATE, sort_order=kv.ASCEND
        )
        response = await etcd_aio.txn(
            self.client.sync,
            [kv.create_revision_is(key, 0)],
            [kv.op_put(key, value, action.lease_id), kv.op_range(heads)],
            [kv.op_get(key)],
            interrupt=interrupt,
        )
        return value, response

    async def _read_standing(
        self, action: recipe.ReadStanding, interrupt: asyncio.Event
    ) -> recipe.StandingAnswer:
        """Steps 2-3: one read-only KV.Txn of two Ranges (keys only, up to our key's
        create_revision): the window ascending, our key and the one ahead descending."""
        common: dict[str, Any] = {
            "keys_only": True,
            "max_create_revision": action.revision,
            "sort_target": kv.CREATE,
        }
        window = kv.prefix_request(
            self.prefix, limit=recipe.window_size(self.max), sort_order=kv.ASCEND, **common
        )
        mine_and_prev = kv.prefix_request(self.prefix, limit=2, sort_order=kv.DESCEND, **common)
        reads = [kv.op_range(window), kv.op_range(mine_and_prev)]
        response = await etcd_aio.txn(self.client.sync, [], reads, [], interrupt=interrupt)
        first, last = (r.response_range.kvs for r in response.responses)
        return recipe.StandingAnswer(
            action.id,
            int(response.header.revision),
            [_key_rev(k) for k in first],
            [_key_rev(k) for k in last],
        )


async def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """``conch.who``, awaited: every key under ``name`` as a Record (the same listing: one
    KV.Range, then one per holder for its hold time). Raises as ``conch.who``."""
    steps = listing(name, max_holders)
    response: rpc_pb2.RangeResponse | None = None
    try:
        while True:
            request = steps.send(response)
            try:
                response = await etcd_aio.range_(client.sync, request)
            except errors.Compacted:
                response = None
    except StopIteration as done:
        records: list[Record] = done.value
        return records
