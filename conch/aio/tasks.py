"""The asyncio face's awaits that outlast a cancel, and what is either awaited or entered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=contextlib.AbstractAsyncContextManager[Any])


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


class Entering(Generic[E]):
    """What ``enter()`` makes: ``await`` it for an E of your own to close, or ``async with``
    it for an E exited (``E.__aexit__``) when the block ends."""

    def __init__(self, enter: Callable[[], Awaitable[E]]) -> None:
        self._enter = enter

    def __await__(self) -> Generator[Any, Any, E]:
        return self._enter().__await__()

    async def __aenter__(self) -> E:
        self._made = await self._enter()
        return self._made

    async def __aexit__(self, *exc: Any) -> None:
        await self._made.__aexit__(*exc)
