"""The counting semaphore recipe of 04_sema.md: enqueue, rank, wait, hold, release, who.

Every holder or waiter owns one key under ``/conch/v1/sema/<name>/<max>/``, bound to its
session's lease. Keys rank by create_revision; the first ``max`` hold a slot.

How a waiter waits (no polling, no herd). The design page says "watch the key at rank r-N";
that alone misses a release when N > 1 and holders leave out of order (N=2, holders A B,
waiter C watching A: B leaves, C stays asleep with a slot free). So:

* the *first* waiter (exactly N keys ahead) watches the deletions under the semaphore's
  prefix (one etcd watcher, so in revision order): the deletion of one of those N keys,
  with no deletion of its own key before it, means it holds a slot at that revision;
  nothing else needs to be read or written before its child starts;
* every later waiter watches its immediate predecessor for deletion or change;
* a waiter that takes a slot, unless it held one from the revision its key was created,
  re-puts its own key under a compare on its create_revision (a *touch*) once it holds: the
  change that tells the next waiter it is now first in line. It happens after the hold is
  confirmed (the child may already run); a failed compare means the hold is lost. With
  max > 1 at once: another holder may leave any moment, and the waiter behind must be
  watching for it. With max 1 only TOUCH_DELAY into the hold: the waiter behind moves up
  while our job runs, so that our release hands it the slot with no read; a shorter job is
  over first and spares etcd and the handoff the touch (the waiter behind then wakes on
  our deletion and reads the queue once).

A release therefore wakes one waiter to take the slot and one to move up: constant work per
release, whatever the length of the queue.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

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
from conch.etcd import kv
from conch.etcd.client import Backoff, Client
from conch.etcd.watch import DELETE, Watch, WatchNotice
from conch.flag import Flag, Mailbox, remaining
from conch.session import Session

CMD_MAX_BYTES = 256
# Seconds a waiter that gives up, or a holder that lost its slot, spends revoking its lease:
# etcd is likely slow or gone then, and the lease expires after its TTL anyway.
WITHDRAW_TIMEOUT = 1.0
# Seconds a new hold waits before it opens the watch on its own key: a short job is over
# by then and never pays for that stream, whose set-up would compete with its release.
# A deletion in between is not missed (the watch starts from our create_revision), only
# noticed later; a lost session is noticed at once.
GUARD_WATCH_DELAY = 0.05
# Seconds into a hold at max 1 before its touch (a hold that waited: the waiter behind
# moves up). A job that ends just as it is made pays the most: the touch and the next
# waiter's move-up compete with its release (about 3 ms more at that handoff, measured),
# small next to half a second; a shorter job never pays for that write.
TOUCH_DELAY = 0.5
REENTRY_BACKOFF_CAP = 2.0  # seconds between attempts to re-enter after a lost session


def default_host() -> str:
    """The node name: ``CONCH_HOST`` if set, else the hostname."""
    return os.environ.get("CONCH_HOST") or socket.gethostname()


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cut_utf8(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 without splitting a character."""
    return text.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


@dataclass(frozen=True)
class Identity:
    """Who holds or waits: the value at every key, one line of JSON (contract section 6)."""

    host: str
    pid: int
    started: str  # UTC RFC 3339; a key says when it was written (``entering``)
    cmd: str

    @classmethod
    def current(cls, argv: Sequence[str] = (), host: str | None = None) -> Identity:
        cmd = cut_utf8(" ".join(argv), CMD_MAX_BYTES)
        return cls(host or default_host(), os.getpid(), _utc_now(), cmd)

    def entering(self) -> Identity:
        """This identity, ``started`` now: what a key written now says (a Semaphore of a
        long-lived service is made long before it queues)."""
        return replace(self, started=_utc_now())

    def to_json(self) -> bytes:
        record = {"host": self.host, "pid": self.pid, "started": self.started, "cmd": self.cmd}
        return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class _Standing:
    """Where our key stands at one revision. If waiting, the keys that matter as they were
    then (keys only: create_revision and mod_revision): when ``first`` in line, the ``max``
    keys ahead and then our own (their deletion matters); else the one key just ahead (any
    change matters)."""

    revision: int
    held: bool
    watched: Sequence[kv.KeyValue] = ()
    first: bool = False

    def changed(self, now: Sequence[kv.RangeResponse]) -> bool:
        """Whether a watched key changed since ``revision``, given one Range of each, in order
        (a deletion; unless ``first``, any change)."""
        for then, response in zip(self.watched, now, strict=True):
            current = response.kvs[0] if response.kvs else None
            if current is None or current.create_revision != then.create_revision:
                return True
            if not self.first and current.mod_revision != then.mod_revision:
                return True
        return False


MAX_CAPACITY = 1_000_000
MAX_LEASE_TTL = 9_000_000_000  # seconds: etcd refuses longer leases


def check_max(max_holders: int) -> None:
    if type(max_holders) is not int or not 1 <= max_holders <= MAX_CAPACITY:
        raise UsageError(f"bad --max {max_holders!r}: want a whole number, 1 to {MAX_CAPACITY}")


class Hold:
    """A slot held: ``revision`` is the fencing token (our key's create_revision), ``lease_id``
    the session's lease. ``lost`` (a Flag) is set when the session is lost or our key is
    deleted; ``on_lost(callback)`` runs ``callback(reason)`` then, from a conch thread.
    ``release()`` (or leaving the ``with`` block) deletes the key and revokes the lease."""

    def __init__(
        self,
        sema: Semaphore,
        session: Session,
        key: bytes,
        revision: int,
        value: bytes,
        touch: bool = False,
        retire: Sequence[Watch] = (),
        held_at: int = 0,
    ) -> None:
        self.name = sema.name
        self.max = sema.max
        self.key = key
        self.revision = revision
        self.session = session
        self.lease_id = session.lease_id
        self.lost = Flag("hold-lost")
        self._client = sema.client
        self._released = Flag("released")
        self._releasing = False  # set before the revoke: the deletion it causes is no loss
        self._release_lock = threading.Lock()
        self._revoked = False  # whether the release's LeaseRevoke was confirmed
        self._revoked_after_loss = False
        self._logged = False
        self._touch_value = value if touch else None  # what our key says, written again
        self._retire = list(retire)  # the waiting watch, cancelled by the guard (not before)
        # A revision at which our key was seen ours and holding: the guard watches from there
        # (from our create_revision, after a long wait, etcd would replay all that history
        # to the watch, or refuse it as compacted).
        self._held_at = held_at or revision
        self._guard = threading.Thread(target=self._guard_key, name="conch-hold", daemon=True)
        # Straight from the keepalive thread: the guard may be inside a call to etcd for
        # seconds (a touch or a Range while etcd hangs) when the session is lost.
        session.lost.add_callback(self._session_lost)

    def _session_lost(self, session_lost: Flag) -> None:
        if not self._releasing:
            self.lost.set(f"session lost: {session_lost.reason}")

    def _start_guard(self) -> None:
        """Start the thread that touches and watches our key. ``Semaphore.acquire`` does it
        before returning; the supervisor does it just after starting the child, because a
        thread's start-up costs the handoff a GIL switch (milliseconds). Until it runs, a
        loss is noticed late, never missed: it subscribes to the session's loss first."""
        if self._guard.ident is None and not self._releasing:
            self._guard.start()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once the hold is lost (at once if it already is)."""
        self.lost.add_callback(lambda flag: callback(str(flag.reason)))

    def _guard_key(self) -> None:
        """Touch our key if due (max 1: from a thread of its own, TOUCH_DELAY into the
        hold), then set ``lost`` when the session is lost or our key is deleted. After any
        watch failure (compaction, broken stream) re-check the key with a Range and watch
        again."""
        box: Mailbox = queue.SimpleQueue()
        self.session.lost.subscribe(box)
        self._released.subscribe(box)
        touch_now = self._touch_value is not None and self.max > 1
        start = self._held_at + 1
        try:
            if touch_now:
                touched = self._touch(box)
                if touched is None:
                    return
                start = touched + 1  # ours at the touch: nothing before it to replay
            if self.lost.is_set():
                return
            with contextlib.suppress(queue.Empty):
                pending = box.get(timeout=GUARD_WATCH_DELAY)
                if pending is self._released or self._releasing:
                    return
                self.lost.set(f"session lost: {self.session.lost.reason}")
                return
            if self._touch_value is not None and not touch_now:
                threading.Thread(target=self._touch_later, name="conch-touch", daemon=True).start()
            _cancel_all(self._retire)
            self._watch_key(box, start)
        finally:
            _cancel_all(self._retire)

    def _touch_later(self) -> None:
        """Touch our key TOUCH_DELAY into the hold (GUARD_WATCH_DELAY of it are over),
        unless released or lost by then."""
        box: Mailbox = queue.SimpleQueue()
        flags = (self.session.lost, self._released, self.lost)
        for flag in flags:
            flag.subscribe(box)
        try:
            with contextlib.suppress(queue.Empty):
                box.get(timeout=TOUCH_DELAY - GUARD_WATCH_DELAY)
                return
            self._touch(box)
        finally:
            for flag in flags:
                flag.unsubscribe(box)

    def _watch_key(self, box: Mailbox, start: int) -> None:
        """The guard proper: watch our key for deletion, from revision ``start``, until
        released or lost."""
        backoff = Backoff()
        pending: Any = None
        while True:
            if pending is None:
                try:
                    watch = Watch(self._client, self.key, start, box.put, only_deletes=True)
                except EtcdError:
                    pass
                else:
                    pending = box.get()
                    watch.cancel()
            item, pending = pending, None
            if item is self._released or self._releasing:
                return
            if item is self.session.lost:
                self.lost.set(f"session lost: {self.session.lost.reason}")
                return
            if isinstance(item, WatchNotice) and item.error is None:
                self.lost.set("our key was deleted (lease revoked or expired, or by hand)")
                return
            # The watch broke or could not start. Pause (a release or a loss cuts it short),
            # then look at the key itself; whether the session is lost is the keepalive's call.
            try:
                pending = box.get(timeout=backoff.next())
                continue
            except queue.Empty:
                pass
            try:
                response = kv.range_(self._client, rpc_pb2.RangeRequest(key=self.key))
            except EtcdError:
                continue
            if self._releasing:
                return  # the release deleted it
            if not response.kvs or response.kvs[0].create_revision != self.revision:
                self.lost.set("our key was deleted")
                return
            start = response.header.revision + 1

    def _touch(self, box: Mailbox) -> int | None:
        """Re-put our key if it is still ours (KV.Txn, compare on create_revision): wakes the
        waiter behind us, which watches our key. Retried with backoff while etcd is away;
        returns the touch's revision, or None when there is nothing left to guard (released,
        lost, or the compare failed: our key is gone, and ``lost`` is set)."""
        assert self._touch_value is not None
        backoff = Backoff()
        while not (self._releasing or self.lost.is_set()):
            try:
                response = kv.txn(
                    self._client,
                    [kv.create_revision_is(self.key, self.revision)],
                    [kv.op_put(self.key, self._touch_value, self.lease_id)],
                    [],
                )
            except EtcdError as exc:
                log.warning("touch-failed", name=self.name, error=str(exc))
                with contextlib.suppress(queue.Empty):
                    box.get(timeout=backoff.next())  # a release or a loss cuts it short
                continue
            if response.succeeded:
                return int(response.header.revision)
            if not self._releasing:
                self.lost.set("our key was deleted (lease revoked or expired, or by hand)")
            return None
        if self.session.lost.is_set() and not self._releasing:
            self.lost.set(f"session lost: {self.session.lost.reason}")
        return None

    def release(self) -> None:
        """Revoke the session's lease (Lease.LeaseRevoke), which deletes our key with it in
        one revision: the waiter first in line holds at that revision. Best effort: on
        failure the lease expires after its TTL. After a loss the revoke is tried for at
        most WITHDRAW_TIMEOUT seconds: etcd is likely unreachable, and the exit must not
        wait on it. Thread-safe; returns once the revoke is over, whichever thread sent it.
        Logs ``released`` once."""
        self._revoke()
        with self._release_lock:
            logged, self._logged = self._logged, True
        if not logged:
            extra = {"after": "loss"} if self._revoked_after_loss else {}
            log.info("released", name=self.name, rev=self.revision, **extra, revoked=self._revoked)

    def _revoke(self) -> None:
        """The release without its log line (the supervisor's reaper sends it the moment the
        child's group is gone; the ``released`` line follows the ``child-exit`` one). A call
        while another thread revokes waits for that revoke to end."""
        with self._release_lock:
            releasing, self._releasing = self._releasing, True
        if releasing:
            self._released.wait()
            return
        self._revoked_after_loss = self.lost.is_set()
        try:
            if self._guard.ident is None:
                _cancel_all(self._retire)  # the guard never ran
            # The guard is woken only after the revoke: its stream teardown would compete
            # with the revoke, which is what the next holder waits for.
            timeout = WITHDRAW_TIMEOUT if self._revoked_after_loss else None
            self._revoked = self.session.close(timeout=timeout)
        finally:
            self._released.set()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``.

    ``ttl`` is the session lease TTL in whole seconds; ``spread`` keys slots by host (one
    per node); ``identity`` is what our key says about us.
    """

    client: Client
    name: str
    max: int
    ttl: int = 10
    spread: bool = False
    identity: Identity = field(default_factory=Identity.current)

    def __post_init__(self) -> None:
        keys.check_name(self.name)
        keys.check_host(self.identity.host)
        check_max(self.max)
        if type(self.ttl) is not int or not 1 <= self.ttl <= MAX_LEASE_TTL:
            raise UsageError(f"bad --ttl {self.ttl!r}: want whole seconds, 1 to {MAX_LEASE_TTL}")
        self.prefix = keys.sema_prefix(self.name, self.max)

    def acquire(self, timeout: float | None = None, interrupt: Flag | None = None) -> Hold:
        """Wait for a slot and return the Hold.

        ``timeout`` in seconds: None waits as long as it takes, 0 tries once (``--nonblock``).
        Each etcd call inside has the client's request timeout (failover to another member
        needs it), so with etcd slow or away the wait can run over by up to that, plus
        WITHDRAW_TIMEOUT (1 s) to withdraw our key.
        ``interrupt``, when set (e.g. by a signal handler), withdraws and raises Interrupted.
        Raises NoSlot when time runs out, Unavailable when no session can be established.
        Whatever ends the wait, our key is deleted unless we hold the slot. A lost session
        while queued re-enters at the back of the queue if time allows.
        """
        hold = self._acquire(timeout, interrupt)
        hold._start_guard()
        return hold

    def _acquire(self, timeout: float | None, interrupt: Flag | None) -> Hold:
        """``acquire`` without starting the Hold's guard (the caller must, at once)."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interrupt = interrupt or Flag("interrupt")
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
                self._before_reentry(exc, deadline, interrupt, backoff)
                continue
            entered = True
            try:
                return self._acquire_with(session, deadline, interrupt, started)
            except (SessionLost, LeaseNotFound, Unavailable) as exc:
                # LeaseNotFound: the lease expired before our first write (a process stopped
                # in between); like any lost session, re-enter.
                session.close(timeout=WITHDRAW_TIMEOUT)
                self._before_reentry(exc, deadline, interrupt, backoff)
            except BaseException:
                session.close(timeout=WITHDRAW_TIMEOUT)
                raise

    def _before_reentry(
        self, cause: Exception, deadline: float | None, interrupt: Flag, backoff: Backoff
    ) -> None:
        """After losing our place: raise NoSlot if time is up, else pause (capped backoff,
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
        self, session: Session, deadline: float | None, interrupt: Flag, started: float
    ) -> Hold:
        box: Mailbox = queue.SimpleQueue()
        session.lost.subscribe(box)
        interrupt.subscribe(box)
        woke_by: list[Watch] = []  # the watch that woke us: closed later, off the handoff
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
            while not standing.held:
                _cancel_all(woke_by)
                woke = self._wait_for_change(standing, box, deadline, interrupt, session)
                if woke is not None:
                    woke_by.append(woke.watch)
                if standing.first and woke is not None and key not in _deleted(woke):
                    # First in line, and one of the max keys ahead went with ours still
                    # there (events come in revision order): we hold at that revision.
                    standing = _Standing(woke.revision, True)
                else:
                    standing = self._standing(key, revision, interrupt)
            log.info(
                "acquired",
                name=self.name,
                max=self.max,
                rev=revision,
                lease=f"{session.lease_id:x}",
                waited=f"{time.monotonic() - started:.3f}s",
            )
            # The waiter behind us may be watching us for the change that says we hold (the
            # Hold's touch). Not if we held from the revision our key was created: nobody
            # saw us wait, a waiter behind us knew where it stood from the start.
            touch = not held_at_creation
            hold = Hold(
                self,
                session,
                key,
                revision,
                value,
                touch=touch,
                retire=woke_by,
                held_at=standing.revision,
            )
            woke_by = []
            return hold
        finally:
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
        to watch. One read-only KV.Txn of two ranges, so both see one revision: the first
        ``max`` keys, and our key with the one just ahead of it (keys only)."""
        mine_and_prev = kv.prefix_request(
            self.prefix,
            limit=2,
            keys_only=True,
            max_create_revision=revision,
            sort_target=kv.CREATE,
            sort_order=kv.DESCEND,
        )
        reads = [kv.op_range(self._heads_request()), kv.op_range(mine_and_prev)]
        response = kv.txn(self.client, [], reads, [], interrupt=interrupt)
        at = int(response.header.revision)
        heads = response.responses[0].response_range.kvs
        if any(h.key == key and h.create_revision == revision for h in heads):
            return _Standing(at, True)
        mine, *ahead = response.responses[1].response_range.kvs or [None]
        if mine is None or mine.key != key:
            raise SessionLost("our key is gone (lease expired or key deleted)")
        if not ahead:
            # Nobody ahead, yet not among the first max: cannot be. Fail closed, re-enter.
            raise SessionLost("inconsistent queue read; re-entering")
        if ahead[0].create_revision <= heads[-1].create_revision:
            return _Standing(at, False, [*heads, mine], first=True)
        return _Standing(at, False, [ahead[0]], False)

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
    ) -> WatchNotice | None:
        """Step 4: sleep until a watched key changes after ``standing.revision``; return the
        notice with its events (its watch still open: the caller cancels it), or None when a
        re-read is due (the watch broke, or a key changed before the watch started). First
        in line, the watch covers the deletions under the whole prefix, and only those of
        watched keys wake us. Raises NoSlot at the deadline, Interrupted on ``interrupt``,
        SessionLost on session loss.

        The watch starts from "now" rather than from ``standing.revision + 1``: etcd serves a
        watch that starts in the past from a catch-up loop that runs every 100 ms, which
        would add up to 100 ms to a handoff. Once etcd confirms the watch (at revision C),
        the gap (standing.revision, C] is closed by reading the watched keys again."""
        if deadline is not None and time.monotonic() >= deadline:
            raise NoSlot(f"no free slot of {self.name}[{self.max}]")
        watch = None
        if standing.watched:
            key, end = standing.watched[0].key, b""
            if standing.first:
                key, end = self.prefix, kv.prefix_end(self.prefix)
            watch = Watch(
                self.client,
                key,
                0,
                box.put,
                range_end=end,
                only_deletes=standing.first,
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

    def _changed_since(self, standing: _Standing, confirmed: int, interrupt: Flag) -> bool:
        """Whether a watched key changed between our read and the watch's start (one KV.Txn
        of a Range per key; skipped when nothing at all happened in between)."""
        if confirmed <= standing.revision:
            return False
        reads = [kv.op_get(w.key) for w in standing.watched]
        response = kv.txn(self.client, [], reads, [], interrupt=interrupt)
        return standing.changed([r.response_range for r in response.responses])


def _cancel_all(watches: list[Watch]) -> None:
    for watch in watches:
        watch.cancel()
    watches.clear()


def _deleted(notice: WatchNotice) -> set[bytes]:
    """The keys a watch notice reports deleted."""
    return {event.kv.key for event in notice.events if event.type == DELETE}


@dataclass(frozen=True)
class Record:
    """One key of ``who()``: ``state`` HELD or WAIT; ``held`` how many slots of (name, max)
    are taken; ``rev`` the key's create_revision; ``lease`` hex. ``note`` says what is wrong
    with a key conch did not write (bad JSON, no lease, bad capacity), empty otherwise."""

    name: str
    max: int | None
    held: int
    state: str
    host: str
    pid: int | None
    started: str
    rev: int
    lease: str
    cmd: str
    note: str = ""

    def to_text(self) -> str:
        """One line, fields in a fixed order; a field with spaces or unprintable characters
        (written by someone else) is shown JSON-quoted so it cannot forge another line."""
        capacity = "?" if self.max is None else str(self.max)
        line = (
            f"{self.name}[{self.held}/{capacity}] {self.state:<4}  {_quoted(self.host)} "
            f"pid={self.pid if self.pid is not None else '?'} "
            f"since={_quoted(self.started or '?')} "
            f"rev={self.rev}"
        )
        return line + (f" note={self.note}" if self.note else "")

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "max": self.max,
                "state": self.state,
                "host": self.host,
                "pid": self.pid,
                "started": self.started,
                "rev": self.rev,
                "lease": self.lease,
                "cmd": self.cmd,
                **({"note": self.note} if self.note else {}),
            },
            ensure_ascii=False,
        )


def _quoted(text: str) -> str:
    if text.isprintable() and " " not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _identity_fields(value: bytes) -> tuple[str, int | None, str, str, str]:
    """host, pid, started, cmd, note from a key's value; tolerant of anything."""
    try:
        data = json.loads(value)
        if not isinstance(data, dict):
            raise ValueError
    except (ValueError, RecursionError):
        return "?", None, "", "", "malformed-value"
    pid = data.get("pid")
    return (
        _as_text(data.get("host"), "?"),
        pid if type(pid) is int else None,
        _as_text(data.get("started"), ""),
        _as_text(data.get("cmd"), ""),
        "",
    )


def _as_text(value: object, missing: str) -> str:
    """A field of a key's JSON value as text: a string as it is, anything else as JSON."""
    if value is None:
        return missing
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """Every key under ``name`` (all capacities), in create_revision order per capacity; the
    capacity ``max_holders`` first when given. One KV.Range; reads only (no lease)."""
    prefix = keys.name_prefix(name)
    response = kv.range_prefix(client, prefix, sort_target=kv.CREATE, sort_order=kv.ASCEND)
    groups: dict[int | None, list[Any]] = {}
    for item in response.kvs:
        parsed = keys.parse_under_name(name, item.key)
        capacity = parsed.max if parsed else None
        if capacity is not None and not 1 <= capacity <= MAX_CAPACITY:
            capacity = None  # no conch writes it: a bad key
        groups.setdefault(capacity, []).append(item)

    def order(capacity: int | None) -> tuple[int, int]:
        if capacity == max_holders and capacity is not None:
            return (0, 0)
        return (1, capacity if capacity is not None else 1 << 62)

    records = []
    for capacity in sorted(groups, key=order):
        items = groups[capacity]
        held = min(len(items), capacity) if capacity is not None else 0
        for rank, item in enumerate(items):
            host, pid, started, cmd, note = _identity_fields(item.value)
            notes = [note] if note else []
            if capacity is None:
                notes.append("bad-key")
            if not item.lease:
                notes.append("no-lease")
            state = "HELD" if capacity is not None and rank < capacity else "WAIT"
            records.append(
                Record(
                    name,
                    capacity,
                    held,
                    state,
                    host,
                    pid,
                    started,
                    int(item.create_revision),
                    f"{item.lease:x}",
                    cmd,
                    ",".join(notes),
                )
            )
    return records
