"""The counting semaphore recipe of 04_sema.md: enqueue, rank, wait, hold, release, who.

Every holder or waiter owns one key under ``/conch/v1/sema/<name>/<max>/``, bound to its
session's lease. Keys rank by create_revision; the first ``max`` hold a slot.

How a waiter waits (no polling, no herd; docs/design.md, "Waiting", has the reasoning). The
design page says "watch the key at rank r-N"; that alone misses a release when N > 1 and
holders leave out of order (N=2, holders A B, waiter C watching A: B leaves, C stays asleep
with a slot free). So the queue has a *window*: its first ``window_size(N)`` keys, the N
holders and the ``window_size(N) - N`` waiters first in line (N + 1, at most 8).

* a waiter in the window watches the deletions under the semaphore's prefix (one etcd
  watcher, so in revision order) and knows, from one read, every key ahead of it: each
  deletion of one of them moves it up with no read, and once fewer than N are left, with no
  deletion of its own key before, it holds a slot at that revision. So the waiter that gets
  a slot gets it from the release's own event, whatever the job's length and the max, and
  nothing is read or written before its child starts;
* a waiter behind the window watches its immediate predecessor for deletion or change;
* a waiter in the window re-puts its own key under a compare on its create_revision (a
  *touch*), once, as soon as the waiter just behind it belongs in the window (fewer than
  ``window_size(N) - 1`` keys ahead of it): the change that tells that waiter to read the
  queue and join the window. The waiter that moves up makes this write, not the new holder:
  a release wakes the holder-to-be and the ``window_size(N) - N - 1`` others in the window,
  and only the last one writes, while the new holder starts its child. A waiter that got its
  slot without passing through that state (a read found it holding, or one event took
  several keys ahead of it) leaves the touch to its Hold (hold.py).

A release therefore wakes the waiters of the window and one behind it: constant work per
release, whatever the length of the queue.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from conchpb.etcdserverpb import rpc_pb2

from conch import keys, log
from conch.errors import (
    EtcdError,
    Interrupted,
    LeaseNotFound,
    NoSlot,
    SessionLost,
    Unavailable,
    UsageError,
)
from conch.etcd import kv, lease
from conch.etcd.client import Backoff, Client, check_timeout
from conch.etcd.watch import DELETE, Watch, WatchNotice
from conch.flag import Flag, Mailbox, remaining
from conch.hold import WITHDRAW_TIMEOUT, Hold, _cancel_all, delete_own_key, touch
from conch.identity import Identity
from conch.session import Session, check_client, check_ttl

REENTRY_BACKOFF_CAP = 2.0  # seconds between attempts to re-enter after a lost session
# Waiters in the window beyond the N holders, at most: each release wakes them all (one
# watch event each), so their number stays small whatever the max.
WINDOW_WAITERS_CAP = 8


def window_size(max_holders: int) -> int:
    """How many keys, from the first by create_revision, the window holds: the holders and
    up to N + 1 waiters (capped), so that N releases in a row still find a waiter in the
    window for each slot before the one behind has joined it."""
    return max_holders + min(max_holders + 1, WINDOW_WAITERS_CAP)


class _Standing(NamedTuple):
    """Where our key stands at one revision. If waiting, the keys that matter as they were
    then (keys only: create_revision and mod_revision): in the ``window``, every key ahead
    and then our own (their deletion matters); else the one key just ahead (any change
    matters)."""

    revision: int
    held: bool
    watched: Sequence[kv.KeyValue] = ()
    window: bool = False

    @property
    def ahead(self) -> int:
        """In the window: how many keys are ahead of ours."""
        return len(self.watched) - 1

    def changed(self, now: Sequence[kv.RangeResponse]) -> bool:
        """Whether a watched key changed since ``revision``, given one Range of each, in order
        (a deletion; unless in the ``window``, any change)."""
        for then, response in zip(self.watched, now, strict=True):
            current = response.kvs[0] if response.kvs else None
            if current is None or current.create_revision != then.create_revision:
                return True
            if not self.window and current.mod_revision != then.mod_revision:
                return True
        return False

    def after(self, notice: WatchNotice, slots: int) -> _Standing:
        """In the window, where we stand after the deletions ``notice`` reports (our own
        key not among them): holding at the revision of the deletion that left fewer than
        ``slots`` keys ahead, else further up, still waiting."""
        *ahead, mine = self.watched
        for event in notice.events:
            if event.type == DELETE:
                ahead = [k for k in ahead if k.key != event.kv.key]
                if len(ahead) < slots:
                    return _Standing(int(event.kv.mod_revision), True)
        return _Standing(notice.revision, False, [*ahead, mine], window=True)


@dataclass(frozen=True)
class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``.

    ``ttl`` is the session lease TTL in whole seconds; ``spread`` keys slots by host (one
    per node); ``identity`` is what our key says about us. Immutable (``max`` is part of
    the semaphore's identity: its keys live under ``<name>/<max>/``); for another capacity
    make another Semaphore. Raises UsageError naming the bad parameter (name, max, ttl,
    the identity's host).
    """

    client: Client
    name: str
    max: int
    ttl: int = 10
    spread: bool = False
    identity: Identity = field(default_factory=Identity.current)
    prefix: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys.check_name(self.name)
        keys.check_host(self.identity.host)
        keys.check_max(self.max)
        check_client(self.client)
        check_ttl(self.ttl)
        object.__setattr__(self, "prefix", keys.sema_prefix(self.name, self.max))

    def acquire(
        self,
        timeout: float | None = None,
        interrupt: Flag | None = None,
        session: Session | None = None,
        *,
        guard: bool = True,
    ) -> Hold:
        """Wait for a slot and return the Hold.

        ``timeout`` in seconds: None waits as long as it takes, 0 tries once (``--nonblock``).
        Each etcd call inside has the client's request timeout (failover to another member
        needs it), so with etcd slow or away the wait can run over by up to that, plus
        WITHDRAW_TIMEOUT (1 s) to withdraw our key.
        ``interrupt``, when set (e.g. by a signal handler), withdraws and raises Interrupted.
        Raises NoSlot when time runs out, Unavailable when no session can be established.
        Whatever ends the wait, our key is deleted unless we hold the slot. A lost session
        while queued re-enters at the back of the queue if time allows. A ``timeout`` that
        is negative, not finite or over 10 years raises UsageError before any etcd call.

        ``session``: a ``conch.Session`` of this client to hold the slot on, shared with
        other holds (``ttl`` is then the session's). Without it the hold gets a lease of
        its own. On a shared session a loss while queued raises SessionLost (a new lease
        is the caller's call, not ours); a second wait for this semaphore on the same
        session raises UsageError while the first waits or holds.

        ``guard=False`` returns the Hold with its guard (the watch on our key, the touch that
        moves the next waiter up) not yet started: the caller must call
        ``hold.start_guard()`` at once (the supervisor does, just after the child's spawn).
        Until then a loss of the session is noticed, a deletion of our key only later.
        """
        hold = self._acquire(timeout, interrupt, session=session)
        if guard:
            hold.start_guard()
        return hold

    def _acquire(
        self, timeout: float | None, interrupt: Flag | None, session: Session | None = None
    ) -> Hold:
        """``acquire`` without starting the Hold's guard (the caller must, at once)."""
        if timeout is not None:
            check_timeout("timeout", timeout, zero=True)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interrupt = interrupt or Flag("interrupt")
        if session is not None:
            return self._acquire_shared(session, deadline, interrupt, started)
        backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
        entered = False
        while True:
            if interrupt.is_set():
                raise Interrupted(interrupt.reason)
            try:
                session = Session(self.client, self.ttl, interrupt)
            except Unavailable as exc:
                if not entered:
                    raise  # no session at all: etcd unreachable (exit 69)
                self.pause_before_reentry(exc, deadline, interrupt, backoff)
                continue
            entered = True
            try:
                return self._acquire_with(session, deadline, interrupt, started)
            except (SessionLost, LeaseNotFound, Unavailable) as exc:
                # LeaseNotFound: the lease expired before our first write (a process stopped
                # in between); like any lost session, re-enter.
                session.close(timeout=WITHDRAW_TIMEOUT)
                self.pause_before_reentry(exc, deadline, interrupt, backoff)
            except BaseException:
                session.close(timeout=WITHDRAW_TIMEOUT)
                raise

    def _acquire_shared(
        self, session: Session, deadline: float | None, interrupt: Flag, started: float
    ) -> Hold:
        """``_acquire`` on a session the caller owns: our key is claimed on it, withdrawn
        by deleting it (never by revoking the lease), and a lost session is raised."""
        if session.client is not self.client:
            raise UsageError("session: belongs to another client than the semaphore")
        key = self._key(session)
        session._claim(key)
        backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
        try:
            while True:
                if interrupt.is_set():
                    raise Interrupted(interrupt.reason)
                if session.lost.is_set():
                    raise SessionLost(f"session lost: {session.lost.reason}")
                try:
                    return self._acquire_with(session, deadline, interrupt, started, shared=True)
                except (SessionLost, LeaseNotFound, Unavailable) as exc:
                    if not _session_lives(session, exc):
                        raise SessionLost(f"session lost while queued: {exc}") from None
                    self.pause_before_reentry(exc, deadline, interrupt, backoff)
        except BaseException:
            session._unclaim(key)
            raise

    def pause_before_reentry(
        self, cause: Exception, deadline: float | None, interrupt: Flag, backoff: Backoff
    ) -> None:
        """After losing our place (a hold lost before its use, too): raise NoSlot if time is
        up, else pause (capped backoff,
        cut short by ``interrupt``) before re-entering at the back of the queue."""
        if deadline is not None and time.monotonic() >= deadline:
            raise NoSlot(f"no slot of {self.name}[{self.max}]: {cause}")
        log.warning("requeue", name=self.name, reason=str(cause))
        pause = backoff.next()
        left = remaining(deadline)
        interrupt.wait(pause if left is None else min(pause, left))

    def _key(self, session: Session) -> bytes:
        if self.spread:
            return keys.spread_key(self.name, self.max, self.identity.host)
        return keys.holder_key(self.name, self.max, session.lease_id)

    def _acquire_with(
        self,
        session: Session,
        deadline: float | None,
        interrupt: Flag,
        started: float,
        shared: bool = False,
    ) -> Hold:
        box: Mailbox = queue.SimpleQueue()
        session.lost.subscribe(box)
        interrupt.subscribe(box)
        woke_by: list[Watch] = []  # the watch that woke us: closed later, off the handoff
        revision = 0
        watching: Watch | None = None  # the window's watch, kept open while we move up
        try:
            key = self._key(session)
            revision, held_at_creation, value = self._enqueue(
                session, key, box, deadline, interrupt
            )
            standing = _Standing(revision, True) if held_at_creation else None
            standing = standing or self._standing(key, revision, interrupt)
            if not standing.held:
                ahead = self._count_ahead(revision, interrupt)
                log.info(
                    "queued",
                    name=self.name,
                    max=self.max,
                    position=ahead + 1,
                    ahead=ahead,
                    rev=revision,
                )
            touched = False  # our key re-put while waiting: the waiter behind has joined
            while not standing.held:
                _cancel_all(woke_by)
                if standing.window and not touched and standing.ahead < self._touch_below:
                    self._touch(session, key, revision, value, interrupt)
                    touched = True
                # Passed on: _wait_for_change closes it unless it returns a notice.
                reuse, watching = watching, None
                woke = self._wait_for_change(standing, box, deadline, interrupt, session, reuse)
                if woke is not None and standing.window and key not in _deleted(woke):
                    # Keys ahead of ours went, ours still there (events come in revision
                    # order): we moved up, or hold at the revision of that deletion.
                    standing = standing.after(woke, self.max)
                    if not standing.held:
                        watching = woke.watch
                        continue
                if woke is not None:
                    woke_by.append(woke.watch)
                if not standing.held:
                    standing = self._standing(key, revision, interrupt)
            log.info(
                "acquired",
                name=self.name,
                max=self.max,
                rev=revision,
                lease=f"{session.lease_id:x}",
                waited=f"{time.monotonic() - started:.3f}s",
            )
            # The waiter behind us may be watching us for the change that says it belongs in
            # the window (the Hold's touch), unless we made it while waiting, or held from
            # the revision our key was created: nobody saw us wait, a waiter behind us knew
            # where it stood from the start.
            touch = not held_at_creation and not touched
            hold = Hold(
                self,
                session,
                key,
                revision,
                value,
                touch=touch,
                retire=woke_by,
                held_at=standing.revision,
                shared=shared,
            )
            woke_by = []
            return hold
        except BaseException:
            if shared:
                _withdraw(self.client, key, revision, session.lease_id)
            raise
        finally:
            if watching is not None:  # the touch failed
                watching.cancel()
            _cancel_all(woke_by)
            session.lost.unsubscribe(box)
            interrupt.unsubscribe(box)

    def _enqueue(
        self, session: Session, key: bytes, box: Mailbox, deadline: float | None, interrupt: Flag
    ) -> tuple[int, bool, bytes]:
        """Step 1: put our key bound to the lease, create-if-absent, and read the first
        ``max`` keys in the same KV.Txn. Returns our key's create_revision, whether we
        hold a slot at that very revision, and the value written. With --spread, a key of
        our host held by another process means no slot: wait for it to go (or raise
        NoSlot), then try again."""
        while True:
            value = self.identity.entering().to_json()
            response = kv.txn(
                self.client,
                [kv.create_revision_is(key, 0)],
                [kv.op_put(key, value, session.lease_id), kv.op_range(self._heads_request())],
                [kv.op_get(key)],
                interrupt=interrupt,
            )
            if response.succeeded:
                heads = response.responses[1].response_range.kvs
                return int(response.header.revision), any(h.key == key for h in heads), value
            found = response.responses[0].response_range.kvs
            if found and found[0].lease == session.lease_id:
                # An earlier attempt of ours went through; where we stood then is unknown.
                return int(found[0].create_revision), False, found[0].value
            if not found:
                continue  # deleted between compare and read: try again
            log.info(
                "spread-busy", name=self.name, host=self.identity.host, rev=found[0].create_revision
            )
            standing = _Standing(int(response.header.revision), False, [found[0]])
            woke = self._wait_for_change(standing, box, deadline, interrupt, session)
            if woke is not None:
                woke.watch.cancel()

    def _standing(self, key: bytes, revision: int, interrupt: Flag) -> _Standing:
        """Steps 2-3: are we among the first ``max`` by create_revision? If not, which keys
        to watch. One read-only KV.Txn of two ranges, so both see one revision (keys only):
        the window up to our key, and our key with the one just ahead of it."""
        window = kv.prefix_request(
            self.prefix,
            limit=window_size(self.max),
            keys_only=True,
            max_create_revision=revision,
            sort_target=kv.CREATE,
            sort_order=kv.ASCEND,
        )
        mine_and_prev = kv.prefix_request(
            self.prefix,
            limit=2,
            keys_only=True,
            max_create_revision=revision,
            sort_target=kv.CREATE,
            sort_order=kv.DESCEND,
        )
        reads = [kv.op_range(window), kv.op_range(mine_and_prev)]
        response = kv.txn(self.client, [], reads, [], interrupt=interrupt)
        at = int(response.header.revision)
        first = list(response.responses[0].response_range.kvs)
        mine, *ahead = response.responses[1].response_range.kvs or [None]
        if mine is None or mine.key != key or mine.create_revision != revision:
            raise SessionLost("our key is gone (lease expired or key deleted)")
        if first[-1].key == key:
            if len(first) <= self.max:
                return _Standing(at, True)
            return _Standing(at, False, first, window=True)
        if not ahead:
            # Nobody ahead, yet not in the window: cannot be. Fail closed, re-enter.
            raise SessionLost("inconsistent queue read; re-entering")
        return _Standing(at, False, [ahead[0]])

    def _heads_request(self) -> rpc_pb2.RangeRequest:
        """The first ``max`` keys by create_revision (the holders), keys only."""
        return kv.prefix_request(
            self.prefix,
            limit=self.max,
            keys_only=True,
            sort_target=kv.CREATE,
            sort_order=kv.ASCEND,
        )

    def _count_ahead(self, revision: int, interrupt: Flag) -> int:
        """How many keys are ahead of ours (for the ``queued`` log line only; etcd's count
        ignores the create_revision filter, so this reads the keys ahead once)."""
        response = kv.range_prefix(
            self.client,
            self.prefix,
            interrupt=interrupt,
            keys_only=True,
            max_create_revision=revision - 1,
        )
        return len(response.kvs)

    def _wait_for_change(
        self,
        standing: _Standing,
        box: Mailbox,
        deadline: float | None,
        interrupt: Flag,
        session: Session,
        watch: Watch | None = None,
    ) -> WatchNotice | None:
        """Step 4: sleep until a watched key changes after ``standing.revision``; return the
        notice with its events (its watch still open: the caller cancels it, or passes it
        back as ``watch`` to go on from there), or None when a re-read is due (the watch
        broke, or a key changed before the watch started). In the window, the watch covers
        the deletions under the whole prefix, and only those of watched keys wake us.
        Raises NoSlot at the deadline, Interrupted on ``interrupt``, SessionLost on session
        loss.

        The watch starts from "now" rather than from ``standing.revision + 1``: etcd serves a
        watch that starts in the past from a catch-up loop that runs every 100 ms, which
        would add up to 100 ms to a handoff. Once etcd confirms the watch (at revision C),
        the gap (standing.revision, C] is closed by reading the watched keys again."""
        if deadline is not None and time.monotonic() >= deadline:
            raise NoSlot(f"no free slot of {self.name}[{self.max}]")
        if watch is None and standing.watched:
            key, end = standing.watched[0].key, b""
            if standing.window:
                key, end = self.prefix, kv.prefix_end(self.prefix)
            watch = Watch(
                self.client,
                key,
                0,
                box.put,
                range_end=end,
                only_deletes=standing.window,
                confirm=True,
            )
        relevant = {item.key for item in standing.watched}
        woke = False
        try:
            while True:
                try:
                    item = box.get(timeout=remaining(deadline))
                except queue.Empty:
                    raise NoSlot(f"no free slot of {self.name}[{self.max}] in time") from None
                if item is interrupt:
                    raise Interrupted(interrupt.reason)
                if item is session.lost:
                    raise SessionLost(f"session lost while queued: {session.lost.reason}")
                if isinstance(item, WatchNotice) and item.watch is watch:
                    if item.error is not None:
                        log.info("rewatch", name=self.name, reason=str(item.error))
                        return None
                    if item.created:
                        if self._changed_since(standing, item.revision, interrupt):
                            return None
                        continue
                    if any(event.kv.key in relevant for event in item.events):
                        woke = True
                        return item
        finally:
            if watch is not None and not woke:
                watch.cancel()

    @property
    def _touch_below(self) -> int:
        """With fewer keys than this ahead of ours, the waiter just behind us (if any)
        belongs in the window."""
        return window_size(self.max) - 1

    def _touch(
        self, session: Session, key: bytes, revision: int, value: bytes, interrupt: Flag
    ) -> None:
        """Re-put our key while waiting: the waiter behind us, watching it, joins the window.
        Raises SessionLost when our key is gone."""
        if not touch(self.client, key, revision, value, session.lease_id, interrupt).succeeded:
            raise SessionLost("our key is gone (lease expired or key deleted)")

    def _changed_since(self, standing: _Standing, confirmed: int, interrupt: Flag) -> bool:
        """Whether a watched key changed between our read and the watch's start (one KV.Txn
        of a Range per key; skipped when nothing at all happened in between)."""
        if confirmed <= standing.revision:
            return False
        reads = [kv.op_get(w.key) for w in standing.watched]
        response = kv.txn(self.client, [], reads, [], interrupt=interrupt)
        return standing.changed([r.response_range for r in response.responses])


def _withdraw(client: Client, key: bytes, revision: int, lease_id: int) -> None:
    """Delete our key from a shared session (its lease lives on), best effort: if etcd
    cannot be reached it stays until the session ends. ``revision`` 0: our enqueue's
    outcome is unknown (etcd went away mid-call), so the key goes if it is on our lease."""
    try:
        if revision:
            delete_own_key(client, key, revision, WITHDRAW_TIMEOUT)
            return
        on_our_lease = rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.LEASE, key=key, lease=lease_id
        )
        kv.txn(client, [on_our_lease], [kv.op_delete(key)], [], timeout=WITHDRAW_TIMEOUT)
    except EtcdError as exc:
        log.warning("withdraw-failed", name=key.decode(errors="replace"), error=str(exc))


def _session_lives(session: Session, cause: Exception) -> bool:
    """After ``cause`` cost a waiter on a shared session its place: whether the session
    can still carry it (not lost or closed, and, when our key went, its lease still
    granted: Lease.LeaseTimeToLive, since a lease revoked from outside reaches the
    keepalive only at its next refresh)."""
    if isinstance(cause, LeaseNotFound) or not session.certainly_alive():
        return False
    if not isinstance(cause, SessionLost):
        return True
    try:
        return lease.time_to_live(session.client, session.lease_id, WITHDRAW_TIMEOUT) > 0
    except EtcdError:
        return True  # etcd away: the keepalive decides


def _deleted(notice: WatchNotice) -> set[bytes]:
    """The keys a watch notice reports deleted."""
    return {event.kv.key for event in notice.events if event.type == DELETE}
