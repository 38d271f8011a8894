"""A slot held: its guard (the watch on our key, the touch that moves the next waiter up)
and its release.

The guard is a few short steps, not a thread: they run on the client's timer thread
(``conch.timer``) and from the client's shared Watch stream, and reach the Hold through
weak references only. So a hold costs no thread of its own, and a Hold nobody references
any more is collected: its finalizer releases it (with a ResourceWarning), and no key or
lease of it outlives it by more than the TTL.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.core.guard import (
    GuardAction,
    GuardAfter,
    GuardCall,
    GuardLook,
    GuardLost,
    GuardMachine,
    GuardStep,
    GuardTouch,
    GuardWatch,
)
from conch.core.loss import Loss, LossReason
from conch.core.messages import KeyRev, Note, TouchOwed
from conch.errors import EtcdError, HoldLost
from conch.etcd import kv
from conch.etcd.client import Backoff, Client
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag
from conch.session import Session
from conch.timer import Cancellable, Scheduler, timer_for, weakly

if TYPE_CHECKING:
    import asyncio

    from conch.semaphore import Semaphore

# Seconds a waiter that gives up, or a holder that lost its slot, spends revoking its lease:
# etcd is likely slow or gone then, and the lease expires after its TTL anyway.
WITHDRAW_TIMEOUT = 1.0


def delete_own_key(client: Client, key: bytes, revision: int, timeout: float | None = None) -> bool:
    """Delete ``key`` if it is still the one created at ``revision`` (one KV.Txn comparing
    its create_revision, so a key someone else made since is left alone). Returns whether
    it was ours to delete. Raises EtcdError."""
    response = kv.txn(
        client,
        [kv.create_revision_is(key, revision)],
        [kv.op_delete(key)],
        [],
        timeout=timeout,
    )
    return bool(response.succeeded)


class _Lease(Protocol):
    """A session as a Hold reads it (either face's)."""

    @property
    def alive_until(self) -> float: ...

    def certainly_alive(self) -> bool: ...


class GuardedHold:
    """What the Holds of both faces share: who they are, ``check``, the deadline, the
    guarded write's answer, the ``released`` line, and the execution of their
    GuardMachine's actions. A face gives it its scheduler (the client's timer thread, or
    the loop) and does the guard's etcd calls (``_call``), feeding what came of each to
    ``_answered``. Timers reach the Hold weakly, so a dropped Hold is still collected."""

    lost: Flag | asyncio.Event
    session: _Lease
    _finalizer: weakref.finalize[Any, Any]
    _forget_session: Callable[[], None]

    def __init__(
        self,
        name: str,
        max_holders: int,
        session: _Lease,
        key: bytes,
        revision: int,
        lease_id: int,
        value: bytes,
        guard: GuardMachine,
        watches: list[Cancellable],
        scheduler: Scheduler,
    ) -> None:
        self.name = name
        self.max = max_holders
        self.key = key
        self.revision = revision
        self.session = session
        self.lease_id = lease_id
        self._since = time.monotonic()  # for the released line's hold time
        self._value = value  # what our key says, written again by the touch
        self._guard = guard
        # The guard's watches (the waiting watch it retires, then its own): a list the
        # finalizer can cancel without reaching the Hold.
        self._watches = watches
        self._scheduler = scheduler
        self._releasing = False  # set before the revoke: the deletion it causes is no loss
        self._revoked_after_loss = False

    def _loss(self) -> object:
        raise NotImplementedError

    def _set_lost(self, loss: Loss) -> None:
        raise NotImplementedError

    def _call(self, action: GuardCall) -> None:
        """Make the etcd call ``action`` asks for; feed what came of it to ``_answered``."""
        raise NotImplementedError

    def _check(self) -> None:
        if self.lost.is_set():
            raise HoldLost(f"hold of {self.name}[{self.max}] lost: {self._loss()}")
        if self._releasing:
            raise HoldLost(f"hold of {self.name}[{self.max}] released")
        if not self.session.certainly_alive():
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: no keepalive confirmed within the TTL"
            )

    def expires_at(self) -> float:
        """The earliest instant, in ``time.monotonic()`` seconds, at which etcd can expire
        this hold's lease: the send time of the last keepalive etcd answered
        (Lease.LeaseKeepAlive) plus the TTL it granted; etcd restarts its countdown when it
        receives a keepalive, after we sent it. Later with every confirmed keepalive; 0.0, an
        instant long past, once the hold is lost or released. Makes no etcd call.

        What it promises assumes that etcd does not expire a lease early, that its clock
        runs at ours' rate, and that this process runs: a pause of the whole process
        (SIGSTOP, a GC pause, a VM paused) stops its timers with it, and a thread that
        resumes after the expiry may finish a step it began before. So bound each step of
        work by it with room to spare (``conch.supervisor.deadline_margin(ttl)``), check it
        again right before acting as the holder (``check()``), and for state in etcd use the
        guarded ``put``/``delete``. ``conch.supervise`` keeps a child to the same deadline
        from a watchdog process, which a pause of this one does not stop."""
        if self.lost.is_set() or self._releasing:
            return 0.0
        return self.session.alive_until

    def _written(self, response: rpc_pb2.TxnResponse) -> int:
        """A guarded write's answer: its revision, or HoldLost when the compare failed."""
        if not response.succeeded:
            self._execute(self._guard.write_refused())
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: our key (create_revision "
                f"{self.revision}) is gone; the guarded write was not made"
            )
        return int(response.header.revision)

    def _loss_at_exit(self) -> HoldLost | None:
        """What leaving the block raises, judged before its release: the loss ``check()``
        sees, unless the block released the hold itself before any loss."""
        was_released = self._releasing
        try:
            self._check()
        except HoldLost as lost:
            return None if was_released and not self._revoked_after_loss else lost
        return None

    def _withdraw_timeout(self) -> float | None:
        """Set the release going (no finalizer left); its timeout: WITHDRAW_TIMEOUT after a
        loss, else the client's."""
        self._finalizer.detach()
        self._revoked_after_loss = self.lost.is_set()
        return WITHDRAW_TIMEOUT if self._revoked_after_loss else None

    def _given_back(self) -> None:
        # The watches go only after the revoke: it is what the next holder waits for.
        _cancel_all(self._watches)
        self._forget_session()

    def _log_released(self, revoked: bool) -> None:
        extra = {"after": "loss"} if self._revoked_after_loss else {}
        log.info(
            "released",
            name=self.name,
            rev=self.revision,
            **extra,
            held=f"{time.monotonic() - self._since:.3f}s",
            revoked=revoked,
        )

    # -- the guard: its actions executed, what came of them fed back ----------------------

    def _done(self) -> bool:
        """Nothing left to guard: released (or releasing), or lost."""
        return self._releasing or self._guard.done

    def _session_lost(self, said: object) -> None:
        """The session's loss (a Loss; the threaded face's session Flag carries it)."""
        reason = said.reason if isinstance(said, Flag) else said
        if not isinstance(reason, Loss):
            reason = Loss(LossReason.NO_KEEPALIVE, str(reason))
        self._execute(self._guard.session_lost(reason))

    def _session_expired(self, loss: Loss) -> None:
        self._execute(self._guard.session_expired(loss))

    def _execute(self, actions: list[GuardAction]) -> None:
        for action in actions:
            if isinstance(action, GuardAfter):
                self._later(action.seconds, action.step)
            elif isinstance(action, GuardLost):
                self._set_lost(action.loss)
            elif isinstance(action, Note):
                emit = log.warning if action.warning else log.info
                emit(action.event, name=self.name, **action.fields)
            else:
                if isinstance(action, GuardWatch):
                    _cancel_all(self._watches)
                self._call(action)

    def _later(self, delay: float, step: GuardStep) -> None:
        """Feed ``step`` to the guard ``delay`` seconds from now, unless the Hold is gone or
        done by then."""
        ref = weakref.ref(self)

        def run() -> None:
            hold = ref()
            if hold is not None and not hold._done():
                hold._execute(hold._guard.step(step))

        self._scheduler.call_later(delay, run)

    def _on_notice(self, notice: WatchNotice) -> None:
        """From the watch on our key: our key deleted, or the watch ended."""
        self._execute(self._guard.notice(ended=notice.error is not None))

    def _answered(self, action: GuardCall, answer: Any) -> None:
        """What came of the etcd call ``action``: its response (for a GuardWatch, the watch
        opened), or the EtcdError it raised."""
        guard, failed = self._guard, isinstance(answer, EtcdError)
        if isinstance(action, GuardTouch):
            if failed:
                actions = guard.touch_failed(action.step, str(answer))
            else:
                revision, succeeded = int(answer.header.revision), bool(answer.succeeded)
                actions = guard.touched(action.step, revision, succeeded)
        elif isinstance(action, GuardLook):
            if failed:
                actions = guard.look_failed()
            else:
                found = answer.kvs[0] if answer.kvs else None
                seen = None if found is None else KeyRev(found.key, found.create_revision, 0)
                actions = guard.looked(seen, int(answer.header.revision))
        elif failed:
            actions = guard.watch_failed()
        else:
            self._watches.append(answer)
            if self._done():  # released or lost while it opened
                _cancel_all(self._watches)
            return
        self._execute(actions)


class Hold(GuardedHold):
    """A slot held: ``revision`` is the fencing token (our key's create_revision), ``lease_id``
    the session's lease. ``lost`` (a Flag) is set when the session is lost or our key is
    deleted; ``on_lost(callback)`` runs ``callback(reason)`` then, from a conch thread.
    ``release()`` (or leaving the ``with`` block) gives the slot back: on a session of its
    own it revokes the lease (key and lease go in one revision), on a shared session it
    deletes our key only (KV.Txn comparing its create_revision). A Hold dropped without
    release is released when collected, with a ResourceWarning."""

    lost: Flag
    session: Session

    def __init__(
        self,
        sema: Semaphore,
        session: Session,
        key: bytes,
        revision: int,
        value: bytes,
        touch: TouchOwed | bool = False,
        retire: Sequence[Watch] = (),
        held_at: int = 0,
        shared: bool = False,
    ) -> None:
        if isinstance(touch, bool):  # True: what a hold that waited owes, by its max
            later = TouchOwed.LATER if sema.max == 1 else TouchOwed.AT_ONCE
            touch = later if touch else TouchOwed.NONE
        self._client = sema.client
        guard = GuardMachine(touch, revision, held_at, Backoff())
        watches: list[Cancellable] = list(retire)
        super().__init__(
            sema.name,
            sema.max,
            session,
            key,
            revision,
            session.lease_id,
            value,
            guard,
            watches,
            timer_for(self._client),
        )
        self.lost = Flag("hold-lost")
        self._shared = shared
        self._released = Flag("released")
        self._release_lock = threading.Lock()
        self._revoked = False  # whether the release's revoke (or delete) was confirmed
        self._logged = False
        # A loss is a WARNING in library mode too; the supervisor, which reports it as an
        # error with what it did to the child, turns this off.
        self._warn_on_loss = True
        self.lost.add_callback(weakly(self._warn_lost))
        # Straight from the keepalive thread: a guard step may be inside a call to etcd for
        # seconds (a touch or a Range while etcd hangs) when the session is lost.
        forget_lost = session.lost.add_callback(weakly(self._session_lost))
        # E passed with no keepalive confirmed: the lease may be gone (a waiter would carry
        # on; a hold cannot promise it is still ours).
        forget_expired = session.on_expired(weakly(self._session_expired))
        self._forget_session = undo_all(forget_lost, forget_expired)
        # A lost hold has nothing left to watch, released or not (the watch would otherwise
        # stay on the client's stream for as long as the Hold is kept).
        self.lost.add_callback(lambda _: _cancel_all(watches))
        self._finalizer = weakref.finalize(
            self, _dropped, session, self._client, key, revision, shared, watches
        )
        self._finalizer.atexit = False  # at exit the lease expires after its TTL
        self._execute(self._guard.made())

    @property
    def _guard_started(self) -> bool:
        return self._guard.started

    def _loss(self) -> object:
        return self.lost.reason

    def _set_lost(self, loss: Loss) -> None:
        self.lost.set(loss)

    def _call(self, action: GuardCall) -> None:
        """On the timer thread (or the watch's reader), as a blocking call."""
        client, key = self._client, self.key
        answer: object
        try:
            if isinstance(action, GuardTouch):
                answer = touch(client, key, self.revision, self._value, self.lease_id)
            elif isinstance(action, GuardLook):
                answer = kv.range_(client, rpc_pb2.RangeRequest(key=key))
            else:
                notice = weakly(self._on_notice)
                answer = Watch(client, key, action.start, notice, only_deletes=True)
        except EtcdError as exc:
            answer = exc
        self._answered(action, answer)

    def start_guard(self) -> None:
        """Start guarding the key (idempotent). ``Semaphore.acquire`` does it before
        returning unless asked not to (``guard=False``); the supervisor does it just after
        starting the child. Until then, a loss is noticed
        late, never missed: the hold subscribes to the session's loss first."""
        with self._release_lock:
            if self._releasing:
                return
            actions = self._guard.start()
        self._execute(actions)

    def _warn_lost(self, lost: Flag) -> None:
        if self._warn_on_loss:
            log.warning("lost", name=self.name, rev=self.revision, reason=str(lost.reason))

    def check(self) -> None:
        """Raise HoldLost unless the hold is certainly ours at this moment: not released,
        the lease certainly alive (a keepalive confirmed within the TTL, on the monotonic
        clock, so a process frozen past its TTL fails the moment it resumes, before the
        keepalive thread has noticed anything) and our key not seen deleted. Makes no etcd
        call: call it right before acting as the holder; for state kept in etcd, the
        guarded ``put``/``delete`` check in etcd itself."""
        self._check()

    def on_lost(self, callback: Callable[[Loss], object]) -> None:
        """Call ``callback(reason)`` (a ``conch.core.loss.Loss``: the message as a str, with
        ``.reason``) once the hold is lost (at once if it already is), from
        the conch thread that saw the loss (the session's keepalive thread, or the client's
        watch reader, which every watch of the client shares): it must not block. Its result
        is ignored, so ``lambda reason: loop.call_soon_threadsafe(...)`` fits."""

        def call(flag: Flag) -> None:
            # the Loss itself: str() of it would drop its reason
            reason = flag.reason
            callback(
                reason if isinstance(reason, Loss) else Loss(LossReason.SESSION_CLOSED, str(reason))
            )

        self.lost.add_callback(call)

    def put(self, key: bytes | str, value: bytes | str, timeout: float | None = None) -> int:
        """Write ``key`` = ``value`` only while this hold is ours: one KV.Txn that compares
        our key's create_revision with ``revision`` and puts if it still matches, so the
        write lands at a revision where we held the slot, or not at all. The key is not
        bound to our lease (it outlives the hold). ``timeout`` in seconds (default: the
        client's request timeout). Returns the revision of the write. Raises HoldLost when
        the compare fails (our key is gone: released, lease expired or revoked; ``lost`` is
        set then, unless released), Unavailable
        or another EtcdError when etcd does not answer (the write may then have happened:
        read it back)."""
        return self._guarded(kv.op_put(to_bytes(key), to_bytes(value)), timeout)

    def delete(self, key: bytes | str, timeout: float | None = None) -> int:
        """Delete ``key`` only while this hold is ours (KV.Txn as in ``put``). Returns the
        revision of the deletion (also when the key was absent). Raises as ``put``."""
        return self._guarded(kv.op_delete(to_bytes(key)), timeout)

    def _guarded(self, op: rpc_pb2.RequestOp, timeout: float | None) -> int:
        compare = [kv.create_revision_is(self.key, self.revision)]
        return self._written(kv.txn(self._client, compare, [op], [], timeout))

    # -- release ---------------------------------------------------------------------------

    def release(self, log_it: bool = True, until: float | None = None) -> None:
        """Give the slot back: on a session of its own, revoke the lease
        (Lease.LeaseRevoke), which deletes our key with it in one revision; on a shared
        session, delete our key (KV.Txn comparing its create_revision). The waiter first in
        line holds at that revision. Best effort: on failure the lease expires after its
        TTL. After a loss it is tried for at most WITHDRAW_TIMEOUT seconds: etcd is likely
        unreachable, and the exit must not wait on it. Thread-safe; returns once the revoke
        is over, whichever thread sent it. Logs ``released`` once: with ``log_it=False`` the
        log line is left to a later ``release()`` (the supervisor releases the moment the
        child's group is gone, and logs once it has logged the child's exit). ``until``: a
        ``time.monotonic()`` instant past which the revoke is not waited for (the supervisor,
        after a loss: past the lease's earliest expiry it can no longer help)."""
        self._revoke(until)
        if not log_it:
            return
        with self._release_lock:
            logged, self._logged = self._logged, True
        if not logged:
            self._log_released(self._revoked)

    def _revoke(self, until: float | None = None) -> None:
        """The release without its log line (the supervisor's reaper sends it the moment the
        child's group is gone; the ``released`` line follows the ``child-exit`` one). A call
        while another thread revokes waits for that revoke to end."""
        with self._release_lock:
            releasing, self._releasing = self._releasing, True
            self._guard.release()
        if releasing:
            self._released.wait()
            return
        try:
            timeout = self._withdraw_timeout()
            if until is not None:
                left = max(0.001, until - time.monotonic())  # the etcd layer takes no 0
                timeout = left if timeout is None else min(timeout, left)
            self._revoked = _give_back(
                self.session, self._client, self.key, self.revision, self._shared, timeout
            )
        finally:
            self._given_back()
            self._released.set()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Release; then raise HoldLost if the hold was lost before the block ended (as
        ``check()`` judges it then), unless the block is already raising."""
        loss = self._loss_at_exit()
        self.release()
        if loss is not None and exc_type is None:
            raise loss

    @property
    def deadline(self) -> float:
        """``expires_at()``, as an instant for ``asyncio.timeout_at`` (asyncio's default loop
        clock is ``time.monotonic()``). Read once, it is the expiry as known then: bound one
        step by it, and move the timeout on as keepalives move the expiry::

            async with asyncio.timeout_at(hold.deadline - margin) as timeout:
                for chunk in chunks:
                    await write(chunk)
                    timeout.reschedule(hold.deadline - margin)

        ``asyncio.TimeoutError`` (TimeoutError) then means: the lease may expire before
        the step would end. Threads: ``remaining()``."""
        return self.expires_at()

    def remaining(self) -> float:
        """Seconds from now until ``expires_at()``, 0.0 once it has passed (or the hold is
        lost or released): the timeout for a threaded wait bounded by the lease, as in
        ``future.result(timeout=hold.remaining() - margin)`` or
        ``done.wait(hold.remaining() - margin)``. Makes no etcd call."""
        return max(0.0, self.expires_at() - time.monotonic())


def undo_all(*undos: Callable[[], object]) -> Callable[[], None]:
    """One function that calls each of ``undos`` (subscriptions' removers)."""

    def undo() -> None:
        for each in undos:
            each()

    return undo


def to_bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else text


def _give_back(
    session: Session,
    client: Client,
    key: bytes,
    revision: int,
    shared: bool,
    timeout: float | None,
) -> bool:
    """Revoke a private session, or delete our key from a shared one; whether confirmed."""
    if not shared:
        return session.close(timeout=timeout)
    try:
        delete_own_key(client, key, revision, timeout)
    except EtcdError as exc:
        log.warning("delete-failed", key=key.decode(errors="replace"), error=str(exc))
        return False
    finally:
        session._unclaim(key)
    return True


def warn_hold_dropped(face: str, key: bytes, revision: int) -> None:
    """Warn (ResourceWarning, pointing at the caller's caller: the collector) and log that
    a Hold of ``face`` ("conch" or "conch.aio") was dropped without release()."""
    warnings.warn(
        f"{face} hold of {key.decode(errors='replace')} (rev {revision}) dropped without "
        "release(); releasing it",
        ResourceWarning,
        stacklevel=3,
    )
    log.warning("hold-dropped", key=key.decode(errors="replace"), rev=revision)


def _dropped(
    session: Session,
    client: Client,
    key: bytes,
    revision: int,
    shared: bool,
    watches: list[Cancellable],
) -> None:
    """A Hold was garbage-collected unreleased: warn, as Python does for an unclosed file,
    and release it from the client's timer thread (not the collecting thread)."""
    warn_hold_dropped("conch", key, revision)

    def give_back() -> None:
        _cancel_all(watches)
        _give_back(session, client, key, revision, shared, None)

    timer_for(client).call_later(0, give_back)


def touch(
    client: Client,
    key: bytes,
    revision: int,
    value: bytes,
    lease_id: int,
) -> rpc_pb2.TxnResponse:
    """Re-put ``key`` (``value``, bound to ``lease_id``) if its create_revision is still
    ``revision``: one KV.Txn whose ``succeeded`` is false when the key is gone. The change
    wakes the waiter behind, which watches the key. Raises EtcdError as ``kv.txn``."""
    return kv.txn(
        client,
        [kv.create_revision_is(key, revision)],
        [kv.op_put(key, value, lease_id)],
        [],
    )


def _cancel_all(watches: list[Cancellable]) -> None:
    # One pop at a time (atomic): a watch appended by another thread meanwhile is
    # cancelled too, never cleared from the list uncancelled.
    while watches:
        try:
            watch = watches.pop()
        except IndexError:
            return
        watch.cancel()
