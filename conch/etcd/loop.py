"""What coroutines' calls need of their event loop: a burst of calls spread over its
iterations and bounded in flight, tasks nobody awaits kept until done, awaits that outlast
a cancel, grpc.aio channels closed on their loop, callbacks handed to it from other threads,
and a blocking call's future awaited (where gRPC's asyncio stack is lost to a fork)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from conch.etcd.endpoints import loop_channels
from conch.timer import PerOwner

T = TypeVar("T")

# Calls a loop starts in one of its iterations: the next ones start in the next iterations,
# in order. 200 acquires created at once started 200 calls in one iteration of 51-54 ms,
# with every other task of the loop waiting behind it.
STARTS_PER_ITERATION = 16
# A loop's calls in flight, at most: 1,000 acquires at once had 1,000, whose gRPC buffers, freed,
# left the process 15-20 MiB larger for good (PSS); 64 at a time queued them as fast.
IN_FLIGHT = 64


class _Admission:
    """The calls one loop started in its current iteration, those in flight, and the futures
    of those waiting for their turn, in order: ``async with`` it around a call's attempt."""

    def __init__(self) -> None:  # no reference to its loop: the loop is its key (weakly)
        self._started = self._flight = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:  # our turn: now, in a later iteration, or once one ends
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._grant()
        try:
            await turn
        except asyncio.CancelledError:
            if not turn.cancelled():  # our turn came just before the cancel
                await self.__aexit__()
            raise

    async def __aexit__(self, *_: object) -> None:
        self._flight -= 1
        self._grant()

    def _grant(self, next_iteration: bool = False) -> None:
        self._started = 0 if next_iteration else self._started
        while self._waiting and self._started < STARTS_PER_ITERATION and self._flight < IN_FLIGHT:
            turn = self._waiting.popleft()
            if not turn.done():  # not cancelled meanwhile
                if not self._started:  # the count of this iteration starts again in the next
                    asyncio.get_running_loop().call_soon(self._grant, True)
                turn.set_result(None)
                self._started, self._flight = self._started + 1, self._flight + 1


admission: PerOwner[asyncio.AbstractEventLoop, _Admission] = PerOwner(lambda _loop: _Admission())

# Tasks started with nobody to await them (a stream's dial, a guard step, a dropped object's
# release): the loop keeps only weak references to tasks, so they are kept here until done.
_background: set[asyncio.Task[Any]] = set()


def spawn(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run ``coroutine`` as a task of its own on ``loop`` (the loop's thread only)."""
    task = loop.create_task(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def outlast_cancel(awaitable: asyncio.Future[T]) -> T:
    """Await ``awaitable`` (a task or future) to its end even if this task is cancelled
    meanwhile (what it does must not be cut short: a withdrawal, a release), then raise
    the CancelledError."""
    cancelled: asyncio.CancelledError | None = None
    while not awaitable.done():
        try:
            await asyncio.shield(awaitable)
        except asyncio.CancelledError as exc:
            cancelled = exc
    result = awaitable.result()  # its own error, or CancelledError if it was cancelled
    if cancelled is not None:
        raise cancelled
    return result


def close_channel(loop: asyncio.AbstractEventLoop | None, channel: Any) -> None:
    """Close a blocking ``channel`` (``loop`` None), or a grpc.aio one bound to ``loop`` from
    any thread: its close cancels its calls, which must happen on their loop (there, or as far
    as it can without it once that loop has ended); gRPC destroys one left open when collected."""

    def close() -> None:
        loop_channels.discard(channel)
        closing = channel.close()  # a coroutine that awaits nothing without a grace
        try:
            closing.send(None)
        except (StopIteration, RuntimeError):  # RuntimeError: the loop ended, calls and all
            return
        closing.close()

    if loop is None:
        channel.close()
    elif running_loop() is loop or not loop.is_running():
        close()
    else:
        call_soon(loop, close)  # a loop closed meanwhile has nothing to cancel


def running_loop() -> asyncio.AbstractEventLoop | None:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop()
    return None


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any) -> None:
    """Schedule ``callback(*args)`` on ``loop`` from any thread; nothing when the loop is
    closed (asyncio.run is over, or the service stopped without waiting for us)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def resolve(future: asyncio.Future[T], result: T) -> None:
    if not future.done():  # cancelled meanwhile
        future.set_result(result)


async def settled(call: grpc.Future[Any]) -> Any:
    """Await a blocking stub's ``.future()`` call on the running loop: its done-callback
    (on gRPC's thread) wakes the loop with ``call_soon_threadsafe``. Returns its response or
    raises its grpc.RpcError; a cancel of the awaiting task cancels the call."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    # A loop closed meanwhile: nobody waits.
    call.add_done_callback(lambda _call: call_soon(loop, resolve, done, None))
    try:
        await done
    except asyncio.CancelledError:
        call.cancel()
        raise
    return call.result()
