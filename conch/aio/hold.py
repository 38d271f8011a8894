"""The asyncio face's Hold: a slot held, and its guard on the loop's timers."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.aio.session import Session, run_callback
from conch.aio.tasks import T, outlast_cancel, spawn  # noqa: F401
from conch.core import guard, messages
from conch.core.guard import GuardAction, GuardMachine, GuardStep
from conch.core.loss import CLOSED, Loss
from conch.errors import EtcdError, HoldLost
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import kv
from conch.etcd.client import Backoff
from conch.etcd.watch import WatchNotice
from conch.hold import (
    WITHDRAW_TIMEOUT,
    log_guard_note,
    session_loss,
    undo_all,
    warn_hold_dropped,
)

# The threaded driver's readings of etcd's answers, shared so that the faces cannot differ.
from conch.timer import weakly

if TYPE_CHECKING:
    from conch.aio.semaphore import Semaphore


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
        held: messages.Held,
        retire: list[etcd_aio.LoopWatch],
        shared: bool,
    ) -> None:
        self.name = sema.name
        self.max = sema.max
        self.key = held.key
        self.revision = held.revision
        self.session = session
        self.lease_id = held.lease_id
        self._since = time.monotonic()  # for the released line's hold time
        self.lost = asyncio.Event()
        self.reason: Loss | None = None
        self._client = sema.client
        self._shared = shared
        self._loop = asyncio.get_running_loop()
        self._releasing = False
        self._released: asyncio.Future[bool] | None = None
        self._revoked_after_loss = False
        self._guard = GuardMachine(held.touch, held.revision, held.held_at, Backoff())
        self._touch_value = held.value if held.touch != messages.TouchOwed.NONE else None
        self._watches = retire  # the guard's: the waiting watch it retires, then its own
        self._callbacks: list[Callable[[Loss], object]] = []
        forget_lost = session._kept.add_listener(weakly(self._session_lost))
        # E passed with no keepalive confirmed: the lease may be gone (a waiter would carry
        # on; a hold cannot promise it is still ours).
        forget_expired = session._kept.add_expiry_listener(weakly(self._session_expired))
        self._forget_session = undo_all(forget_lost, forget_expired)
        self._finalizer = weakref.finalize(
            self, _hold_dropped, self._loop, session, self.key, self.revision, shared, retire
        )
        self._finalizer.atexit = False  # at exit the lease expires after its TTL
        self._start_guard()

    # -- loss --------------------------------------------------------------------------

    def _session_lost(self, reason: Loss) -> None:
        self._execute(self._guard.session_lost(session_loss(reason)))

    def _session_expired(self, loss: Loss) -> None:
        self._execute(self._guard.session_expired(loss))

    def _set_lost(self, reason: Loss) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        log.warning("lost", name=self.name, rev=self.revision, reason=reason)
        _cancel_watches(self._watches)
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            run_callback(callback, reason)

    def on_lost(self, callback: Callable[[Loss], object]) -> None:
        """Call ``callback(reason)`` (a ``conch.core.loss.Loss``: the message as a str, with
        ``.reason``) on the loop once the hold is lost (soon, if it already
        is). It must not block; its result is ignored."""
        if self.lost.is_set():
            self._loop.call_soon(run_callback, callback, self.reason or CLOSED)
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
            self._execute(self._guard.write_refused())
            raise HoldLost(
                f"hold of {self.name}[{self.max}] lost: our key (create_revision "
                f"{self.revision}) is gone; the guarded write was not made"
            )
        return int(response.header.revision)

    # -- the guard (loop timers; the Hold reached weakly) ------------------------------

    def _done(self) -> bool:
        return self._releasing or self._guard.done

    def _execute(self, actions: list[GuardAction]) -> None:
        """Run the guard's ``actions`` on the loop: timers as ``call_later``, calls to etcd
        as tasks (reaching the Hold weakly)."""
        for action in actions:
            if isinstance(action, guard.GuardAfter):
                self._later(action.seconds, action.step)
            elif isinstance(action, guard.GuardTouch):
                spawn(self._loop, self._touch(action.step))
            elif isinstance(action, guard.GuardWatch):
                spawn(self._loop, self._open_watch(action.start))
            elif isinstance(action, guard.GuardLook):
                spawn(self._loop, self._look_at_key())
            elif isinstance(action, guard.GuardLost):
                self._set_lost(action.loss)
            else:
                log_guard_note(self.name, action)

    def _later(self, delay: float, step: GuardStep) -> None:
        """Feed ``step`` to the guard ``delay`` seconds from now, unless the Hold is gone or
        done by then."""
        ref = weakref.ref(self)

        def run() -> None:
            hold = ref()
            if hold is not None and not hold._done():
                hold._execute(hold._guard.step(step))

        self._loop.call_later(delay, run)

    def _start_guard(self) -> None:
        """The guard's schedule (``GuardMachine``, as the threaded Hold's): the touch owed at
        once, the watch on our key a moment in, a later touch at max 1."""
        self._execute(self._guard.made())
        self._execute(self._guard.start())

    async def _open_watch(self, start: int) -> None:
        _cancel_watches(self._watches)
        try:
            watch = await etcd_aio.LoopWatch.open(
                self._client.sync, weakly(self._on_notice), self.key, start, only_deletes=True
            )
        except EtcdError:
            self._execute(self._guard.watch_failed())
            return
        self._watches.append(watch)
        if self._done():  # released or lost while it opened
            _cancel_watches(self._watches)

    def _on_notice(self, notice: WatchNotice) -> None:
        """On the loop: our key deleted, or the watch ended."""
        self._execute(self._guard.notice(ended=notice.error is not None))

    async def _look_at_key(self) -> None:
        try:
            response = await etcd_aio.range_(self._client.sync, rpc_pb2.RangeRequest(key=self.key))
        except EtcdError:
            self._execute(self._guard.look_failed())
            return
        found = response.kvs[0] if response.kvs else None
        seen = None if found is None else messages.KeyRev(found.key, found.create_revision, 0)
        self._execute(self._guard.looked(seen, int(response.header.revision)))

    async def _touch(self, step: GuardStep) -> None:
        """Re-put our key if it is still ours (KV.Txn, compare on create_revision): wakes
        the waiter behind us."""
        assert self._touch_value is not None
        try:
            response = await touch(
                self._client.sync, self.key, self.revision, self._touch_value, self.lease_id
            )
        except EtcdError as exc:
            self._execute(self._guard.touch_failed(step, str(exc)))
            return
        answer = self._guard.touched(step, int(response.header.revision), bool(response.succeeded))
        self._execute(answer)

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
            self._guard.release()
            self._finalizer.detach()
            self._revoked_after_loss = self.lost.is_set()
            self._released = self._loop.create_task(self._give_back())
        await outlast_cancel(self._released)

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
        log.info(
            "released",
            name=self.name,
            rev=self.revision,
            **extra,
            held=f"{time.monotonic() - self._since:.3f}s",
            revoked=revoked,
        )
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


async def touch(
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
        spawn(loop, _give_back(session, session.client.sync, key, revision, shared, None))

    etcd_aio.call_soon(loop, give_back)
