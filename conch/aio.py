"""conch for asyncio: the threaded API's shape, for coroutines (timeouts in seconds)::

    import conch.aio

    async with conch.aio.connect("10.0.0.1:2379") as client:
        sema = conch.aio.Semaphore(client, "reports", max=2, ttl=10)
        async with sema.acquire(timeout=30) as hold:   # raises conch.NoSlot after 30 s
            hold.revision      # fencing token: our key's create_revision
            hold.lease_id      # the session's lease
            hold.lost          # an asyncio.Event, set when the hold is lost
            await hold.check() # raises conch.HoldLost unless the hold is certainly ours
            ...                # the critical section
        await conch.aio.who(client, "reports")   # [conch.Record, ...]

A bridge over the threaded core, not a second recipe: every blocking call (the wait for a slot,
a release, a listing, the dial) runs on a thread of its own, started for that call, and
hands its result to the loop with ``loop.call_soon_threadsafe``. So the event loop never
blocks on etcd, and nothing here uses the loop's default executor: a service whose executor
is small or busy cannot deadlock its holds (and a waiting acquire, which may wait for hours,
never takes one of its workers).

Cancelling a waiting acquire (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``)
sets the wait's ``interrupt`` Flag, which withdraws our key (the lease is revoked), and waits
for that before the cancellation propagates. If the slot was granted just as the cancel came,
the hold is released before it propagates. Either way no key is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from conch import errors
from conch.etcd import client as etcd_client
from conch.flag import Flag
from conch.hold import Hold as _Hold
from conch.identity import Identity
from conch.listing import Record
from conch.listing import who as _who
from conch.semaphore import Semaphore as _Semaphore

T = TypeVar("T")

__all__ = ["Client", "Hold", "Semaphore", "connect", "who"]


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any
) -> bool:
    """Schedule ``callback(*args)`` on ``loop`` from any thread; False if the loop is closed
    (asyncio.run is over, or the service stopped without waiting for us)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _off_loop(
    call: Callable[[], T], what: str, undo: Callable[[T], object] | None = None
) -> asyncio.Future[T]:
    """Run ``call()`` on a new daemon thread; its result or exception settles the returned
    future on the running loop. ``undo(result)`` runs, on a thread, when nobody can receive
    the result: the future was cancelled meanwhile, or the loop is closed (a Client dialled
    or a Hold granted for a caller gone is closed or released, not left behind)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T) -> None:  # on the loop
        if not future.done():
            future.set_result(result)
        elif undo is not None:
            _in_thread(lambda: undo(result), f"undo-{what}")

    def fail(error: BaseException) -> None:  # on the loop
        if not future.done():
            future.set_exception(error)

    def run() -> None:
        try:
            result = call()
        except BaseException as exc:  # handed to the awaiting coroutine, which raises it
            _call_soon(loop, fail, exc)
            return
        if not _call_soon(loop, settle, result) and undo is not None:
            undo(result)

    _in_thread(run, what)
    return future


def _in_thread(run: Callable[[], object], what: str) -> None:
    threading.Thread(target=run, name=f"conch-aio-{what}", daemon=True).start()


async def _outlast_cancel(future: asyncio.Future[T]) -> T:
    """Await ``future`` to its end even if this task is cancelled meanwhile (the thread
    behind it runs to its own deadline regardless), then raise the CancelledError."""
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if future.done():
                raise  # the call is over (a cancel coming with its end): nothing to outlast
            cancelled = exc
            continue
        if cancelled is not None:
            raise cancelled
        return result


class Client:
    """An etcd client for coroutines: ``sync`` is the threaded ``conch.etcd.Client`` behind
    it (its calls block; use them off the loop). ``await client.close()`` closes its
    channels."""

    def __init__(self, sync: etcd_client.Client) -> None:
        self.sync = sync

    async def close(self) -> None:
        await _off_loop(self.sync.close, "close")

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class connect:  # a function to its callers: ``async with connect(...)``
    """``async with connect(endpoints, ...) as client`` (or ``client = await connect(...)``):
    a Client dialled within ``dial_timeout`` seconds, closed when the block ends. Arguments
    and errors as ``conch.connect`` (UsageError, Unavailable, AuthenticationFailed); the
    dial (Maintenance.Status, or Auth.Authenticate with credentials) runs off the loop."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        dial_timeout: float = 5.0,
        request_timeout: float = 5.0,
        tls: etcd_client.TLS | None = None,
        credentials: etcd_client.Credentials | None = None,
    ) -> None:
        self._dial = lambda: etcd_client.connect(
            endpoints, dial_timeout, request_timeout, tls, credentials
        )
        self._client: Client | None = None

    async def _connect(self) -> Client:
        # A cancel propagates at once; a client dialled meanwhile is closed when it comes.
        return Client(await _off_loop(self._dial, "connect", undo=etcd_client.Client.close))

    def __await__(self) -> Generator[Any, None, Client]:
        return self._connect().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._connect()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


class Hold:
    """A slot held, for coroutines: ``revision`` is the fencing token (our key's
    create_revision), ``lease_id`` the session's lease, ``lost`` an ``asyncio.Event`` set
    (on the loop) when the session is lost or our key deleted. ``sync`` is the threaded
    ``conch.Hold`` behind it. Leaving ``async with`` releases the hold, and raises HoldLost
    if the hold was lost (unless the block is already raising)."""

    def __init__(self, sync: _Hold, loop: asyncio.AbstractEventLoop) -> None:
        self.sync = sync
        self.name = sync.name
        self.max = sync.max
        self.revision = sync.revision
        self.lease_id = sync.lease_id
        self.lost = asyncio.Event()
        self._loop = loop
        sync.lost.add_callback(self._lost_in_thread)

    def _lost_in_thread(self, _flag: Flag) -> None:
        _call_soon(self._loop, self.lost.set)

    @property
    def reason(self) -> str | None:
        """Why the hold was lost; None while it is not."""
        return str(self.sync.lost.reason) if self.sync.lost.is_set() else None

    async def check(self) -> None:
        """Raise HoldLost unless the hold is certainly ours now (``conch.Hold.check``: the
        lease confirmed alive within the TTL on the monotonic clock, our key not seen
        deleted). Makes no etcd call, so it does not leave the loop."""
        self.sync.check()

    def on_lost(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(reason)`` on the loop once the hold is lost (soon, if it already
        is). Not called once the loop is closed."""

        def in_thread(flag: Flag) -> None:
            _call_soon(self._loop, callback, str(flag.reason))

        self.sync.lost.add_callback(in_thread)

    async def release(self) -> None:
        """Revoke the lease (``conch.Hold.release``: Lease.LeaseRevoke), off the loop. A
        cancel while it runs waits for the revoke to end, then propagates."""
        await _outlast_cancel(_off_loop(self.sync.release, "release"))

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lost: errors.HoldLost | None = None
        try:
            self.sync.check()
        except errors.HoldLost as failed:
            lost = failed
        await self.release()
        if lost is not None and exc is None:
            raise lost


class _Acquiring:
    """What ``Semaphore.acquire`` returns: ``async with`` it, or ``await`` it for a Hold to
    release yourself."""

    def __init__(self, sema: _Semaphore, timeout: float | None) -> None:
        self._sema = sema
        self._timeout = timeout
        self._hold: Hold | None = None

    async def _acquire(self) -> Hold:
        loop = asyncio.get_running_loop()
        interrupt = Flag("cancelled")
        waiting = _off_loop(
            lambda: self._sema.acquire(self._timeout, interrupt), "acquire", _Hold.release
        )
        try:
            sync = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            # Withdraw our key before the cancel propagates; a slot granted just now (the
            # thread was past its last look at the interrupt) is released.
            interrupt.set("cancelled")
            await _outlast_cancel(asyncio.ensure_future(_release_if_granted(waiting)))
            raise
        return Hold(sync, loop)

    def __await__(self) -> Generator[Any, None, Hold]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Hold:
        self._hold = await self._acquire()
        return self._hold

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hold is not None
        await self._hold.__aexit__(exc_type, exc, traceback)


async def _release_if_granted(waiting: asyncio.Future[_Hold]) -> None:
    """After an interrupted wait: release the hold if it came all the same. Run as a task of
    its own, so a second cancel cannot stop it between the grant and the release."""
    with contextlib.suppress(errors.ConchError):  # Interrupted, NoSlot...: no key left
        granted = await waiting
        await _off_loop(granted.release, "release")


class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``, for coroutines: arguments and
    UsageError as ``conch.Semaphore`` (checked here, no etcd call). ``sync`` is the threaded
    ``conch.Semaphore`` behind it: one recipe for both."""

    def __init__(
        self,
        client: Client,
        name: str,
        max: int,
        ttl: int = 10,
        spread: bool = False,
        identity: Identity | None = None,
    ) -> None:
        extra = {} if identity is None else {"identity": identity}
        self.sync = _Semaphore(client.sync, name, max=max, ttl=ttl, spread=spread, **extra)
        self.name = name
        self.max = max

    def acquire(self, timeout: float | None = None) -> _Acquiring:
        """``async with sema.acquire(timeout) as hold``: wait for a slot, on a thread of
        conch's own (``conch.Semaphore.acquire``). ``timeout`` in seconds: None waits as
        long as it takes, 0 tries once. Raises NoSlot when time runs out, Unavailable when
        no session can be established. Cancelling the waiting task withdraws our key (or
        releases a slot granted meanwhile) before the CancelledError leaves it."""
        return _Acquiring(self.sync, timeout)


async def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """``conch.who`` off the loop: every key under ``name`` as a Record (one KV.Range)."""
    return await _off_loop(lambda: _who(client.sync, name, max_holders), "who")
