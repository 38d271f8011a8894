"""One timer thread per client: the short steps at given times of its holds' guards, its
watch stream and its keepalives, one after another (a step that calls etcd, always with a
deadline, makes those behind it wait): a thread per client, not per hold (docs/design.md).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from conch import log

OwnerT = TypeVar("OwnerT")
ValueT = TypeVar("ValueT")

# Seconds the thread stays up with nothing to do before it ends (the next call_later
# starts it again): a client with no hold left costs no thread.
IDLE_EXIT = 5.0


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """What runs the steps of the keepalives, the watch hub and the holds' guards: a ``Timer``,
    or an asyncio loop (on its thread only; a function that raises goes to its handler)."""

    def call_later(self, delay: float, function: Callable[[], Any]) -> Cancellable: ...


@dataclass(order=True, slots=True)
class Handle:
    """A call ``Timer.call_later`` scheduled, due at ``when``; ``cancel()`` drops it unrun."""

    when: float
    order: int  # ties in call_later's order
    function: Callable[[], Any] | None = field(compare=False)

    def cancel(self) -> None:
        self.function = None


class Timer:
    """Calls functions at given ``time.monotonic()`` times, in order, on one daemon thread."""

    def __init__(self, name: str = "conch-timer") -> None:
        self._name = name
        self._queue: list[Handle] = []
        self._order = itertools.count()
        self._wake = threading.Condition(threading.Lock())
        self._running = False

    def call_later(self, delay: float, function: Callable[[], Any]) -> Handle:
        """Call ``function()`` from the timer thread ``delay`` seconds from now (0: at once);
        one that raises is logged, the next still run. Raises RuntimeError when the thread
        cannot be started (the call is dropped; the next call_later tries again)."""
        with self._wake:
            handle = Handle(time.monotonic() + max(0.0, delay), next(self._order), function)
            heapq.heappush(self._queue, handle)
            if not self._running:
                # Marked running only once the thread is there (a failed start must not leave
                # later calls waiting for no thread); the new thread waits for this lock.
                try:
                    threading.Thread(target=self._run, name=self._name, daemon=True).start()
                except BaseException:
                    handle.cancel()  # the caller is told it failed: it must not run later
                    raise
                self._running = True
            elif self._queue[0] is handle:
                self._wake.notify()
        return handle

    def _run(self) -> None:
        while True:
            with self._wake:
                # Cancelled calls at the head go before the wait is set: a keepalive answered
                # in time cancels its deadline and its ask to another member (no wake-up).
                while self._queue and self._queue[0].function is None:
                    heapq.heappop(self._queue)
                now = time.monotonic()
                if not self._queue or self._queue[0].when > now:
                    wait = self._queue[0].when - now if self._queue else IDLE_EXIT
                    if not self._wake.wait(wait) and not self._queue:
                        self._running = False
                        return
                    continue
                # The handle lets go of it: the caller may keep the handle for long.
                handle = heapq.heappop(self._queue)
                function, handle.function = handle.function, None
            if function is not None:  # not cancelled meanwhile
                try:
                    function()
                except Exception as exc:  # one step's bug must not stop every other hold's
                    log.error("timer-call-failed", call=repr(function), error=repr(exc))
            # Not kept while the thread waits: a call may hold the last reference to a
            # session or client that should be collected now.
            del function, handle


class PerOwner(Generic[OwnerT, ValueT]):
    """One ``make(owner)`` per owner, made on first use under a lock, gone with the owner
    (held by weak reference): calling it with an owner returns that owner's one value."""

    def __init__(self, make: Callable[[OwnerT], ValueT]) -> None:
        self._make = make
        self._made: weakref.WeakKeyDictionary[OwnerT, ValueT] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, owner: OwnerT) -> ValueT:
        with self._lock:
            value = self._made.get(owner)
            if value is None:
                value = self._made[owner] = self._make(owner)
            return value


# The one Timer of an owner (a Client), made on first use, gone with the owner.
timer_for: PerOwner[object, Timer] = PerOwner(lambda _owner: Timer())


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """A callback calling bound ``method`` through a weak reference (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def listen(listeners: dict[object, ValueT], listener: ValueT) -> Callable[[], None]:
    key = object()
    listeners[key] = listener

    def remove() -> None:
        listeners.pop(key, None)

    return remove
