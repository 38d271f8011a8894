"""The asyncio face's Hold: a slot held, and its guard on the loop's timers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from conchpb.etcdserverpb import rpc_pb2

from conch import log
from conch.aio.session import Session
from conch.core.guard import GuardCall, GuardStep
from conch.core.loss import CLOSED, Loss
from conch.core.messages import Held
from conch.errors import EtcdError
from conch.etcd import aio as etcd_aio
from conch.etcd import kv
from conch.etcd.aio import LoopWatch
from conch.etcd.loop import outlast_cancel, spawn
from conch.hold import GuardedHold, Slot, giving_back, to_bytes
from conch.timer import weakly

if TYPE_CHECKING:
    from conch.aio.semaphore import Semaphore


class Hold(GuardedHold[Session], contextlib.AbstractAsyncContextManager["Hold"]):
    """A slot held, for coroutines: ``conch.Hold``, awaited, but ``lost`` is an
    ``asyncio.Event`` (``reason`` says why) and its guard starts at once, on the loop."""

    def __init__(
        self, sema: Semaphore, session: Session, held: Held, retire: list[LoopWatch], shared: bool
    ) -> None:
        self._loop = loop = asyncio.get_running_loop()
        super().__init__(sema, session, held, shared, retire, loop)
        self.lost = asyncio.Event()
        self.reason: Loss | None = None
        self._client = sema.client.sync
        self._released: asyncio.Future[None] | None = None
        self._callbacks: list[Callable[[Loss], object]] = []
        self._slot.forgets.append(session._kept.add_listener(weakly(self._session_lost)))
        soon = functools.partial(etcd_aio.call_soon, loop)
        self._drop_with("conch.aio", soon, lambda slot, _: spawn(loop, _give_back(slot, None)))
        self._execute(self._guard.made() + self._guard.start())

    def _set_lost(self, reason: Loss) -> None:
        self.reason = reason
        self.lost.set()
        while self._callbacks:  # each once, in order
            log.call_back(self._callbacks.pop(0), reason)

    def on_lost(self, callback: Callable[[Loss], object]) -> None:
        """``conch.Hold.on_lost``, on the loop (soon, if the hold is already lost)."""
        if self.lost.is_set():
            self._loop.call_soon(log.call_back, callback, self.reason or CLOSED)
        else:
            self._callbacks.append(callback)

    async def check(self) -> None:
        """``conch.Hold.check``: raise HoldLost unless the hold is certainly ours now."""
        self._check()

    async def put(self, key: bytes | str, value: bytes | str, timeout: float | None = None) -> int:
        """``conch.Hold.put``, awaited (one KV.Txn): the revision of the write; raises as it."""
        return await self._guarded(kv.op_put(to_bytes(key), to_bytes(value)), timeout)

    async def delete(self, key: bytes | str, timeout: float | None = None) -> int:
        """``conch.Hold.delete``, awaited (one KV.Txn): the revision; raises as ``put``."""
        return await self._guarded(kv.op_delete(to_bytes(key)), timeout)

    async def _guarded(self, op: rpc_pb2.RequestOp, timeout: float | None) -> int:
        return self._written(await etcd_aio.txn(self._client, self._ours, [op], [], timeout))

    def _call(self, action: GuardCall) -> None:
        spawn(self._loop, self._ask(action))

    async def _ask(self, action: GuardCall) -> None:
        client, key = self._client, self.key
        answer: object
        try:
            if action.step is GuardStep.WATCH_OWN_KEY:
                notice = weakly(self._on_notice)
                answer = await LoopWatch.open(client, notice, key, action.start, only_deletes=True)
            elif action.step is GuardStep.LOOK:
                answer = await etcd_aio.range_(client, rpc_pb2.RangeRequest(key=key))
            else:
                answer = await etcd_aio.txn(client, self._ours, self._touch, [])
        except EtcdError as exc:
            answer = exc
        self._answered(action, answer)

    async def release(self) -> None:
        """``conch.Hold.release``, awaited (Lease.LeaseRevoke, or a KV.Txn from a shared
        session). A second call waits for the first; a cancel waits for it, then propagates."""
        if self._released is None:
            self._released = self._loop.create_task(self._give_back(self._releasing()))
        await outlast_cancel(self._released)

    async def _give_back(self, timeout: float | None) -> None:
        self._log_released(await _give_back(self._slot, timeout))

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """As ``conch.Hold.__exit__``, awaited."""
        loss = self._loss_at_exit()
        await self.release()
        if loss is not None and exc_type is None:
            raise loss


async def _give_back(slot: Slot[Session], timeout: float | None) -> bool:
    with giving_back(slot) as ours:
        if not slot.shared:
            return await slot.session.close(timeout)
        await etcd_aio.txn(slot.session.client.sync, ours, [kv.op_delete(slot.key)], [], timeout)
        return True
    return False
