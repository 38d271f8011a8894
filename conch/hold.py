"""A slot held: its guard (the watch on our key, the touch that moves the next waiter up)
and its release."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.errors import EtcdError, HoldLost
from conch.etcd import kv
from conch.etcd.client import Backoff, Client
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag, Mailbox
from conch.session import Session

if TYPE_CHECKING:
    from conch.semaphore import Semaphore

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

    def check(self) -> None:
        """Raise HoldLost unless the hold is certainly ours at this moment: the lease is
        certainly alive (a keepalive confirmed within the TTL, on the monotonic clock, so a
        process frozen past its TTL fails at once) and our key has not been seen deleted.
        Makes no etcd call."""
        if self.lost.is_set():
            raise HoldLost(f"hold of {self.name}[{self.max}] lost: {self.lost.reason}")
        if not self.session.certainly_alive():
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: no keepalive confirmed within the TTL"
            )

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
                response = touch(
                    self._client, self.key, self.revision, self._touch_value, self.lease_id
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


def touch(
    client: Client,
    key: bytes,
    revision: int,
    value: bytes,
    lease_id: int,
    interrupt: Flag | None = None,
) -> rpc_pb2.TxnResponse:
    """Re-put ``key`` (``value``, bound to ``lease_id``) if its create_revision is still
    ``revision``: one KV.Txn whose ``succeeded`` is false when the key is gone. The change
    wakes the waiter behind, which watches the key. Raises EtcdError as ``kv.txn``."""
    return kv.txn(
        client,
        [kv.create_revision_is(key, revision)],
        [kv.op_put(key, value, lease_id)],
        [],
        interrupt=interrupt,
    )


def _cancel_all(watches: list[Watch]) -> None:
    for watch in watches:
        watch.cancel()
    watches.clear()
