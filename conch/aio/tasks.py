"""Tasks of the asyncio face that nobody awaits, and awaits that outlast a cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


# Tasks started with nobody to await them (a guard step, a dropped object's release): the
# loop keeps only weak references to tasks, so they are kept here until done.
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
    while True:
        try:
            result = await asyncio.shield(awaitable)
        except asyncio.CancelledError as exc:
            if awaitable.done():
                if awaitable.cancelled():
                    raise
                result = awaitable.result()
            else:
                cancelled = exc
                continue
        if cancelled is not None:
            raise cancelled
        return result
