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

The one recipe (``conch.core.waiter.Waiter``), driven with awaits: unary calls are grpc.aio
calls on the loop (``Client.call_async``); watches and keepalives ride one Watch and one
LeaseKeepAlive stream per client and loop, read by the loop (``conch.etcd.aio``); delays and
a hold's guard (``conch.core.guard.GuardMachine``) are the loop's timers. So a waiting
acquire costs no thread, and nothing here uses the loop's default executor.

Cancelling a waiting acquire (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``)
feeds the machine an interrupt: it withdraws our key (a private session's lease revoked, a
shared session's key deleted), and the cancel propagates once that is over. If the slot was
granted just as the cancel came, the hold is released before it propagates. Either way no
key is left behind. A request already sent when the cancel comes is answered first (each
has the client's request timeout), so that no write lands after the withdrawal.

What differs from the threaded face is how a call waits, never what it decides: no
``interrupt=`` (cancel the task instead); ``hold.lost`` an ``asyncio.Event`` (a
``conch.Flag`` in threads) with the reason in ``hold.reason``; ``check``, ``put``,
``delete``, ``release`` and ``who`` awaited; ``on_lost`` callbacks on the loop; no
``remaining()`` (bound a step with ``asyncio.timeout_at(hold.deadline)`` on asyncio's own
loop, whose clock is ``time.monotonic()``). A hold from ``await sema.acquire()`` is an
async context manager too (``async with hold:`` releases it).
"""

from __future__ import annotations

from conch.aio.client import Client, connect
from conch.aio.hold import Hold
from conch.aio.semaphore import Semaphore, who
from conch.aio.session import Session

__all__ = ["Client", "Hold", "Semaphore", "Session", "connect", "who"]
