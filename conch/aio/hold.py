"""The asyncio face's Hold: a slot held, and its guard on the loop's timers."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.aio.session import Session, run_callback
from conch.aio.tasks import outlast_cancel, spawn
from conch.core import messages
from conch.core.guard import GuardCall, GuardLook, GuardMachine, GuardTouch
from conch.core.loss import CLOSED, Loss
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import client as etcd_client
from conch.etcd import kv
from conch.etcd.client import Backoff
from conch.hold import GuardedHold, _cancel_all, to_bytes, undo_all, warn_hold_dropped
from conch.timer import Cancellable, LoopTimer, weakly

if TYPE_CHECKING:
    from conch.aio.semaphore import Semaphore


class Hold(GuardedHold):
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

    lost: asyncio.Event
    session: Session

    def __init__(
        self,
        sema: Semaphore,
        session: Session,
        held: messages.Held,
        retire: list[etcd_aio.LoopWatch],
        shared: bool,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        guard = GuardMachine(held.touch, held.revision, held.held_at, Backoff())
        watches: list[Cancellable] = list(retire)
        super().__init__(
            sema.name,
            sema.max,
            session,
            held.key,
            held.revision,
            held.lease_id,
            held.value,
            guard,
            watches,
            LoopTimer(self._loop),
        )
        self.lost = asyncio.Event()
        self.reason: Loss | None = None
        self._client = sema.client
        self._shared = shared
        self._released: asyncio.Future[bool] | None = None
        self._callbacks: list[Callable[[Loss], object]] = []
        forget_lost = session._kept.add_listener(weakly(self._session_lost))
        # E passed with no keepalive confirmed: the lease may be gone (a waiter would carry
        # on; a hold cannot promise it is still ours).
        forget_expired = session._kept.add_expiry_listener(weakly(self._session_expired))
        self._forget_session = undo_all(forget_lost, forget_expired)
        self._finalizer = weakref.finalize(
            self, _hold_dropped, self._loop, session, self.key, self.revision, shared, watches
        )
        self._finalizer.atexit = False  # at exit the lease expires after its TTL
        # The guard's schedule (as the threaded Hold's): the touch owed at once, the watch
        # on our key a moment in, a later touch at max 1.
        self._execute(self._guard.made())
        self._execute(self._guard.start())

    # -- loss --------------------------------------------------------------------------

    def _loss(self) -> object:
        return self.reason

    def _set_lost(self, reason: Loss) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        log.warning("lost", name=self.name, rev=self.revision, reason=reason)
        _cancel_all(self._watches)
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
        return await self._guarded(kv.op_put(to_bytes(key), to_bytes(value)), timeout)

    async def delete(self, key: bytes | str, timeout: float | None = None) -> int:
        """Delete ``key`` only while this hold is ours (KV.Txn as in ``put``). Returns the
        revision of the deletion (also when the key was absent). Raises as ``put``."""
        return await self._guarded(kv.op_delete(to_bytes(key)), timeout)

    async def _guarded(self, op: rpc_pb2.RequestOp, timeout: float | None) -> int:
        compare = [kv.create_revision_is(self.key, self.revision)]
        return self._written(await etcd_aio.txn(self._client.sync, compare, [op], [], timeout))

    # -- the guard's etcd calls, as tasks on the loop ------------------------------------

    def _call(self, action: GuardCall) -> None:
        spawn(self._loop, self._ask(action))

    async def _ask(self, action: GuardCall) -> None:
        client, key = self._client.sync, self.key
        answer: object
        try:
            if isinstance(action, GuardTouch):
                put = kv.op_put(key, self._value, self.lease_id)
                compare = [kv.create_revision_is(key, self.revision)]
                answer = await etcd_aio.txn(client, compare, [put], [])
            elif isinstance(action, GuardLook):
                answer = await etcd_aio.range_(client, rpc_pb2.RangeRequest(key=key))
            else:
                notice = weakly(self._on_notice)
                start = action.start
                answer = await etcd_aio.LoopWatch.open(
                    client, notice, key, start, only_deletes=True
                )
        except EtcdError as exc:
            answer = exc
        self._answered(action, answer)

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
            timeout = self._withdraw_timeout()
            self._released = self._loop.create_task(self._give_back(timeout))
        await outlast_cancel(self._released)

    async def _give_back(self, timeout: float | None) -> bool:
        try:
            revoked = await _give_back(
                self.session, self._client.sync, self.key, self.revision, self._shared, timeout
            )
        finally:
            self._given_back()
        self._log_released(revoked)
        return revoked

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Release; then raise HoldLost if the hold was lost before the block ended (as
        ``check()`` judges it then), unless the block is already raising or released the
        hold itself before any loss."""
        loss = self._loss_at_exit()
        await self.release()
        if loss is not None and exc_type is None:
            raise loss


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
    watches: list[Cancellable],
) -> None:
    """A Hold was garbage-collected unreleased: warn, and release it on its loop."""
    warn_hold_dropped("conch.aio", key, revision)

    def give_back() -> None:
        _cancel_all(watches)
        spawn(loop, _give_back(session, session.client.sync, key, revision, shared, None))

    etcd_aio.call_soon(loop, give_back)
