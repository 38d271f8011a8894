"""One-shot flags that several waiters can watch at once: each wait is a *mailbox* (a
``queue.SimpleQueue``, whose reentrant ``put`` a signal handler may call) that every source
it waits on puts a message into (docs/design.md, "Flags and mailboxes")."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from conch import log

Mailbox = queue.SimpleQueue[Any]


class Flag:
    """A one-shot event: ``set(reason)`` once, then every subscriber and waiter learns of it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reason: object = None
        self._set = False
        self._boxes: list[Mailbox] = []
        # Callbacks not yet run: whichever thread pops one runs it, so each runs once even when
        # add_callback() races set() (dict.pop is atomic; no lock: set() runs in signal handlers).
        self._callbacks: dict[object, Callable[[Flag], object]] = {}
        self._first = threading.Lock()  # taken, never released, by the one set() that wins

    def is_set(self) -> bool:
        return self._set

    def set(self, reason: object = None) -> None:
        """Set the flag (first call wins). Safe from signal handlers and any thread."""
        # Not blocking: a handler that interrupted a set() in this thread must not wait for it.
        if self._set or not self._first.acquire(blocking=False):
            return
        self.reason = reason
        self._set = True
        for box in tuple(self._boxes):
            box.put(self)
        for key in tuple(self._callbacks):
            self._run(key)

    def subscribe(self, box: Mailbox) -> None:
        """Put ``self`` into ``box`` when set (at once if already set)."""
        self._boxes.append(box)
        if self._set:
            box.put(self)

    def unsubscribe(self, box: Mailbox) -> None:
        with contextlib.suppress(ValueError):
            self._boxes.remove(box)

    def add_callback(self, callback: Callable[[Flag], object]) -> Callable[[], None]:
        """Call ``callback(flag)`` once when set, from the setting thread (at once if already
        set). A callback that raises is logged; the others still run. Returns a function
        that removes it (a long-lived flag must not collect callbacks of done things)."""
        key = object()
        self._callbacks[key] = callback
        if self._set:
            self._run(key)

        def remove() -> None:
            self._callbacks.pop(key, None)

        return remove

    def _run(self, key: object) -> None:
        callback = self._callbacks.pop(key, None)
        if callback is not None:  # else another thread ran it
            log.call_back(callback, self, flag=self.name)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` seconds pass; return whether it is set."""
        box: Mailbox = queue.SimpleQueue()
        self.subscribe(box)
        try:
            with contextlib.suppress(queue.Empty):
                box.get(timeout=timeout)
        finally:
            self.unsubscribe(box)
        return self._set


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic()`` based), >= 0; None stays None."""
    if deadline is None:
        return None
    # Clamped, so that an absurd deadline waits long instead of overflowing the timeout.
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX / 2)
