"""A slot held: its guard (the watch on our key, the touch that moves the next waiter up)
and its release. The guard's steps run on the client's timer thread (``conch.timer``) and
Watch stream and reach the Hold weakly: a Hold nobody references is collected, and its
finalizer releases it (ResourceWarning): no key or lease of it outlives it by over the TTL.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.core import guard as g
from conch.core.loss import Loss
from conch.core.messages import Held, KeyRev, Note
from conch.errors import EtcdError, HoldLost
from conch.etcd import kv
from conch.etcd.client import Backoff
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag
from conch.session import Session, SessionBase
from conch.timer import Cancellable, Scheduler, listen, timer_for, weakly

if TYPE_CHECKING:
    from conch.semaphore import Recipe, Semaphore

# Seconds a waiter that gives up, or a holder that lost its slot, spends revoking its lease:
# etcd is likely slow or gone then, and the lease expires after its TTL anyway.
WITHDRAW_TIMEOUT = 1.0

SessionT = TypeVar("SessionT", bound=SessionBase[Any])
Soon = Callable[[Callable[[], object]], object]  # runs a function soon, on the face's thread


@dataclass(frozen=True)
class Slot(Generic[SessionT]):
    """What giving a slot back takes (apart from the Hold, for its finalizer): our key at
    create_revision ``revision`` on ``session`` (its own unless ``shared``), the watches, the
    session subscriptions' removers."""

    session: SessionT
    key: bytes
    revision: int
    shared: bool
    watches: list[Cancellable]
    forgets: list[Callable[[], None]]


@contextlib.contextmanager
def giving_back(slot: Slot[Any]) -> Iterator[list[rpc_pb2.Compare]]:
    # Around a give-back, whose delete of our key from a shared session is one KV.Txn on the
    # compare given (its create_revision: a key made since by someone else is left alone): an
    # EtcdError is logged and suppressed. Either way the session's claim on the key goes, then
    # the watches and subscriptions: only after the revoke, what the next holder waits for.
    try:
        yield [kv.create_revision_is(slot.key, slot.revision)]
    except EtcdError as exc:
        log.warning("delete-failed", key=slot.key.decode(errors="replace"), error=str(exc))
    finally:
        slot.session._unclaim(slot.key)
        _cancel_all(slot.watches)
        for forget in slot.forgets:
            forget()


class GuardedHold(Generic[SessionT]):
    """What the Holds of both faces share: who they are, ``check``, the deadline, the loss,
    the ``released`` line, and the execution of their guard machine's actions. A face gives
    its scheduler (the client's timer thread, or the loop), sets its ``lost`` (``_set_lost``)
    and makes the guard's etcd calls (``_call``), feeding each answer to ``_answered``."""

    _set_lost: Callable[[Loss], None]
    _call: Callable[[g.GuardCall], None]

    def __init__(
        self,
        sema: Recipe,
        session: SessionT,
        held: Held,
        shared: bool,
        retire: Sequence[Cancellable],
        scheduler: Scheduler,
    ) -> None:
        self.name = sema.name
        self.max = sema.max
        self._who = f"hold of {sema.name}[{sema.max}]"
        self.key = held.key
        self.revision = held.revision
        self.session = session
        self.lease_id = held.lease_id
        self._since = time.monotonic()  # for the released line's hold time
        # Every write of ours compares our key's create_revision; the touch puts our key
        # again (its value, on our lease), which wakes the waiter behind us, watching it.
        self._ours = [kv.create_revision_is(held.key, held.revision)]
        self._touch = [kv.op_put(held.key, held.value, held.lease_id)]
        self._guard = g.GuardMachine(held.touch, held.revision, held.held_at, Backoff().next)
        self._slot = Slot(session, held.key, held.revision, shared, list(retire), forgets=[])
        self._scheduler = scheduler
        self._fed = weakly(self._feed)
        # E passed with no keepalive confirmed is a loss.
        expired = functools.partial(self._fed, self._guard.session_ended)
        self._slot.forgets.append(listen(session._kept.expiry_listeners, expired))
        # A loss is a WARNING in library mode too; the supervisor, which reports it as an
        # error with what it did to the child, turns this off.
        self._warn_on_loss = True

    def _drop_with(self, face: str, soon: Soon, give_back: Callable[..., object]) -> None:
        # Its finalizer holds the Slot, never the Hold: see _dropped.
        self._finalizer = weakref.finalize(self, _dropped, face, self._slot, soon, give_back)
        self._finalizer.atexit = False  # at exit the lease expires after its TTL

    def _check(self) -> None:
        if self._guard.lost is not None:
            raise HoldLost(f"{self._who} lost: {self._guard.lost}")
        if self._guard.releasing:
            raise HoldLost(f"{self._who} released")
        if not self.session.certainly_alive():
            raise HoldLost(f"{self._who} lost: no keepalive confirmed within the TTL")

    def expires_at(self) -> float:
        """The earliest instant (``time.monotonic()`` seconds) etcd can expire this hold's
        lease: the send time of the last keepalive etcd answered (Lease.LeaseKeepAlive) plus
        the TTL (etcd restarts its countdown on receipt). Later with every confirmed
        keepalive; 0.0 once lost or released. No etcd call. A pause of the process stops its
        timers too: bound each step of work by it with room to spare
        (``conch.supervisor.deadline_margin(ttl)``), ``check()`` right before acting as the
        holder, and for state in etcd use the guarded ``put``/``delete``."""
        return 0.0 if self._guard.done else self.session.alive_until

    @property
    def deadline(self) -> float:
        """``expires_at()``, as an instant for ``asyncio.timeout_at`` on a loop whose clock is
        ``time.monotonic()`` (the default loop's; else ``hold.deadline - time.monotonic() +
        loop.time()``). Read once, it is the expiry as known then: bound one step by it, and
        move the timeout on as keepalives move the expiry::

            async with asyncio.timeout_at(hold.deadline - margin) as timeout:
                for chunk in chunks:
                    await write(chunk)
                    timeout.reschedule(hold.deadline - margin)

        TimeoutError then means: the lease may expire before the step would end. Threads:
        ``conch.Hold.remaining()``."""
        return self.expires_at()

    def _written(self, response: rpc_pb2.TxnResponse) -> int:
        if not response.succeeded:
            self._execute(self._guard.write_refused())
            raise HoldLost(
                f"{self._who} lost: our key (create_revision {self.revision}) is gone; "
                "the guarded write was not made"
            )
        return int(response.header.revision)

    def _loss_at_exit(self) -> HoldLost | None:
        # Judged before the release: none if the block released the hold before any loss.
        try:
            self._check()
        except HoldLost as lost:
            return None if self._guard.releasing and self._guard.lost is None else lost
        return None

    def _releasing(self) -> float | None:
        self._guard.release()
        self._finalizer.detach()
        return WITHDRAW_TIMEOUT if self._guard.lost is not None else None

    def _log_released(self, revoked: bool) -> None:
        extra = {"after": "loss"} if self._guard.lost is not None else {}
        held = f"{time.monotonic() - self._since:.3f}s"
        log.info("released", name=self.name, rev=self.revision, **extra, held=held, revoked=revoked)

    def _session_lost(self, said: Flag | Loss) -> None:
        # A threaded session's lost Flag, which only its declare_lost sets, with the Loss.
        loss = said.reason if isinstance(said, Flag) else said
        self._execute(self._guard.session_ended(cast(Loss, loss), lost=True))

    def _feed(self, input: Callable[..., list[g.GuardAction]], *args: Any) -> None:
        self._execute(input(*args))

    def _execute(self, actions: list[g.GuardAction]) -> None:
        for action in actions:
            if isinstance(action, g.GuardAfter):
                due = functools.partial(self._fed, self._guard.step, action.step)
                self._scheduler.call_later(action.seconds, due)
            elif isinstance(action, Loss):
                if self._warn_on_loss:
                    log.warning("lost", name=self.name, rev=self.revision, reason=str(action))
                # A lost hold has nothing left to watch, released or not (the watch would
                # otherwise stay on the client's stream for as long as the Hold is kept).
                _cancel_all(self._slot.watches)
                self._set_lost(action)
            elif isinstance(action, Note):
                emit = log.warning if action.warning else log.info
                emit(action.event, name=self.name, **action.fields)
            else:
                if action.step is g.GuardStep.WATCH_OWN_KEY:
                    _cancel_all(self._slot.watches)
                self._call(action)

    def _on_notice(self, notice: WatchNotice) -> None:
        self._execute(self._guard.notice(ended=notice.error is not None))

    def _answered(self, action: g.GuardCall, answer: Any) -> None:
        # Its response (for a watch, the watch opened), or the EtcdError it raised.
        guard, step, failed = self._guard, action.step, isinstance(answer, EtcdError)
        if step is g.GuardStep.WATCH_OWN_KEY and not failed:
            self._slot.watches.append(answer)
            if guard.done:  # released or lost while it opened
                _cancel_all(self._slot.watches)
            return
        if step is g.GuardStep.LOOK and not failed:
            found = answer.kvs[0] if answer.kvs else None
            seen = None if found is None else KeyRev(found.key, found.create_revision, 0)
            actions = guard.looked(seen, int(answer.header.revision))
        elif not failed:
            actions = guard.touched(step, int(answer.header.revision), bool(answer.succeeded))
        elif step in (g.GuardStep.WATCH_OWN_KEY, g.GuardStep.LOOK):
            actions = guard.watch_failed()
        else:
            actions = guard.touch_failed(step, str(answer))
        self._execute(actions)


class Hold(GuardedHold[Session], contextlib.AbstractContextManager["Hold"]):
    """A slot held: ``revision`` is the fencing token (our key's create_revision), ``lease_id``
    the session's lease. ``lost`` (a Flag) is set when the session is lost or our key is
    deleted; ``on_lost(callback)`` runs ``callback(reason)`` then, from a conch thread.
    ``release()`` (or leaving the ``with`` block) gives the slot back: a session of its own
    is revoked, key and lease in one revision; from a shared one our key is deleted. A Hold
    dropped without release is released when collected, with a ResourceWarning."""

    def __init__(
        self, sema: Semaphore, session: Session, held: Held, retire: Sequence[Watch], shared: bool
    ) -> None:
        self._client = client = sema.client
        self.lost = Flag("hold-lost")
        self._set_lost = self.lost.set
        super().__init__(sema, session, held, shared, retire, timer_for(client))
        self._release_lock = threading.Lock()
        self._revoked = False  # whether the release's revoke (or delete) was confirmed
        self._logged = False
        # Straight from the keepalive thread: a guard step may be inside a call to etcd for
        # seconds (a touch or a Range while etcd hangs) when the session is lost.
        self._slot.forgets.append(session.lost.add_callback(weakly(self._session_lost)))
        self._drop_with("conch", functools.partial(timer_for(client).call_later, 0), _give_back)
        self._execute(self._guard.made())

    def _call(self, action: g.GuardCall) -> None:
        # On the timer thread (or the watch's reader), as a blocking call.
        client, key = self._client, self.key
        answer: object
        try:
            if action.step is g.GuardStep.WATCH_OWN_KEY:
                notice = weakly(self._on_notice)
                answer = Watch(client, key, action.start, notice, only_deletes=True)
            elif action.step is g.GuardStep.LOOK:
                answer = kv.range_(client, rpc_pb2.RangeRequest(key=key))
            else:
                answer = kv.txn(client, self._ours, self._touch, [])
        except EtcdError as exc:
            answer = exc
        self._answered(action, answer)

    def start_guard(self) -> None:
        """Start guarding the key (idempotent): ``Semaphore.acquire`` does unless
        ``guard=False``; the supervisor does just after starting the child. Until then, a
        loss is noticed late, never missed: the hold subscribes to the session's loss first."""
        self._execute(self._guard.start())

    def check(self) -> None:
        """Raise HoldLost unless the hold is certainly ours now: not released, the lease
        certainly alive (a keepalive confirmed within the TTL on the monotonic clock: a
        process frozen past it fails at once on resuming), our key not seen deleted. No etcd
        call: use it right before acting as the holder (state in etcd: ``put``/``delete``)."""
        self._check()

    def on_lost(self, callback: Callable[[Loss], object]) -> None:
        """Call ``callback(reason)`` (a ``conch.core.loss.Loss``: a str, with ``.reason``)
        once the hold is lost (at once if it is), from the conch thread that saw it (keepalive
        or watch reader): it must not block; its result is ignored, so ``lambda reason:
        loop.call_soon_threadsafe(...)`` fits."""
        # The Loss itself: only _set_lost sets lost.
        self.lost.add_callback(lambda flag: callback(cast(Loss, flag.reason)))

    def put(self, key: bytes | str, value: bytes | str, timeout: float | None = None) -> int:
        """Write ``key`` = ``value`` only while this hold is ours: one KV.Txn that puts if our
        key's create_revision is still ``revision`` (so it lands where we held the slot, or
        not at all); the key is not bound to our lease. ``timeout`` in seconds (default: the
        client's). Returns the revision of the write. Raises HoldLost when the compare fails
        (our key is gone; ``lost`` is set then, unless released), Unavailable or another
        EtcdError when etcd does not answer (the write may then have happened: read it back)."""
        return self._guarded(kv.op_put(to_bytes(key), to_bytes(value)), timeout)

    def delete(self, key: bytes | str, timeout: float | None = None) -> int:
        """Delete ``key`` only while this hold is ours (KV.Txn as in ``put``). Returns the
        revision of the deletion (also when the key was absent). Raises as ``put``."""
        return self._guarded(kv.op_delete(to_bytes(key)), timeout)

    def _guarded(self, op: rpc_pb2.RequestOp, timeout: float | None) -> int:
        return self._written(kv.txn(self._client, self._ours, [op], [], timeout))

    def release(self, log_it: bool = True, until: float | None = None) -> None:
        """Give the slot back: on a session of its own, revoke the lease (Lease.LeaseRevoke),
        which deletes our key with it in one revision; on a shared session, delete our key
        (KV.Txn comparing its create_revision). The first waiter holds at that revision. Best
        effort: on failure the lease expires after its TTL; after a loss it is tried for at
        most WITHDRAW_TIMEOUT seconds. Thread-safe; returns once the revoke is over, whoever
        sent it. Logs ``released`` once (``log_it=False``: left to a later ``release()``).
        ``until``: a ``time.monotonic()`` instant past which the revoke is not waited for."""
        with self._release_lock:  # held through the revoke: a second call waits for it
            if not self._guard.releasing:
                timeout = self._releasing()
                if until is not None:
                    left = max(0.001, until - time.monotonic())  # the etcd layer takes no 0
                    timeout = left if timeout is None else min(timeout, left)
                self._revoked = _give_back(self._slot, timeout)
            logged, self._logged = self._logged, self._logged or log_it
        if log_it and not logged:
            self._log_released(self._revoked)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Release; then raise HoldLost if the hold was lost before the block ended (as
        ``check()`` judges it), unless raising already or released before any loss."""
        loss = self._loss_at_exit()
        self.release()
        if loss is not None and exc_type is None:
            raise loss

    def remaining(self) -> float:
        """Seconds until ``expires_at()`` (0.0 once passed, lost or released; no etcd call),
        as a threaded wait's timeout: ``done.wait(hold.remaining() - margin)``."""
        return max(0.0, self.expires_at() - time.monotonic())


def to_bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else text


def _give_back(slot: Slot[Session], timeout: float | None) -> bool:
    with giving_back(slot) as ours:
        if not slot.shared:
            return slot.session.close(timeout=timeout)
        kv.txn(slot.session.client, ours, [kv.op_delete(slot.key)], [], timeout)
        return True
    return False


def _dropped(face: str, slot: Slot[Any], soon: Soon, give_back: Callable[..., object]) -> None:
    """A Hold of ``face`` collected unreleased: warn (ResourceWarning, as for an unclosed file)
    and log; then, on the face's thread (``soon``), give it back."""
    key = slot.key.decode(errors="replace")
    message = f"{face} hold of {key} (rev {slot.revision}) dropped without release(); releasing it"
    warnings.warn(message, ResourceWarning, stacklevel=2)
    log.warning("hold-dropped", key=key, rev=slot.revision)
    soon(lambda: give_back(slot, None))


def _cancel_all(watches: list[Cancellable]) -> None:
    # One pop at a time (atomic): a watch appended by another thread meanwhile is
    # cancelled too, never cleared from the list uncancelled.
    with contextlib.suppress(IndexError):
        while watches:
            watches.pop().cancel()
