"""conch for asyncio: the threaded API's shape, for coroutines (timeouts in seconds)::

    import conch.aio

    async with conch.aio.connect("10.0.0.1:2379") as client:
        sema = conch.aio.Semaphore(client, "reports", max=2, ttl=10)
        async with sema.acquire(timeout=30) as hold:   # raises conch.NoSlot after 30 s
            hold.revision      # fencing token: our key's create_revision
            hold.lease_id      # the session's lease
            hold.lost          # an asyncio.Event, set when the hold is lost
            await hold.check() # raises conch.HoldLost unless the hold is certainly ours
            await hold.put(key, value)   # a write that lands only while the slot is ours
            ...                # the critical section
        await conch.aio.who(client, "reports")   # [conch.Record, ...]

        async with conch.aio.Session(client, ttl=10) as session:  # one lease, several holds
            hold = await sema.acquire(timeout=30, session=session)

Each wait is the one recipe (``conch.core.waiter.Waiter``) driven with awaits on the loop:
no thread per call, waiter or hold, nothing on the loop's default executor. Cancelling a
waiting acquire (``task.cancel()``, ``asyncio.timeout``) withdraws our key, or releases a
slot granted just then, before the CancelledError propagates: no key is left behind.

What differs from the threaded face is how a call waits, never what it decides: no
``interrupt=`` (cancel the task); ``hold.lost`` an ``asyncio.Event`` (reason in
``hold.reason``); ``check``, ``put``, ``delete``, ``release`` and ``who`` awaited;
``on_lost`` callbacks on the loop; no ``remaining()`` (``asyncio.timeout_at(hold.deadline)``
on asyncio's own loop); ``async with hold:`` releases a hold from ``await sema.acquire()``.
How, and why: docs/embedding.md, "asyncio".
"""

from conch.aio.client import Client, connect
from conch.aio.hold import Hold
from conch.aio.semaphore import Semaphore, who
from conch.aio.session import Session

__all__ = ["Client", "Hold", "Semaphore", "Session", "connect", "who"]
