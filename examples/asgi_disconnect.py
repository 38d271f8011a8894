"""A web request queued for a slot, whose client goes away: withdraw it, do not run its job.

A plain ASGI app (no framework). ``GET /job?id=ID`` waits for one of ``CONCH_EXAMPLE_MAX``
slots of the semaphore ``CONCH_EXAMPLE_NAME``, runs the job (``CONCH_EXAMPLE_JOB`` seconds;
each job that starts appends ``ID`` to the file ``CONCH_EXAMPLE_RAN``, if set), and answers
``200 ran ID``; ``503`` when no slot came within ``CONCH_EXAMPLE_WAIT`` seconds.

uvicorn does not cancel a handler whose client disconnects: it only makes the next
``receive()`` return ``{"type": "http.disconnect"}``. A handler that just awaits the
acquire stays queued after its client is gone, takes the slot in its turn and runs a job
nobody will see (``GET /job-naive``, kept here for comparison). ``acquire_or_gone()`` races
the acquire against the disconnect and cancels the acquire when the client goes first;
``conch.aio`` withdraws our key before the cancellation leaves ``acquire()``, so the
abandoned request leaves the queue at once and nothing of it is left in etcd.

    CONCH_ENDPOINTS=127.0.0.1:2379 uvicorn examples.asgi_disconnect:app --port 8080
    curl 'http://127.0.0.1:8080/job?id=1'

uvicorn is not a dependency of conch: ``pip install .[bench]`` brings it.
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import conch
import conch.aio

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone (ASGI ``http.disconnect``). Reads, and drops, the
    request body: read a body you need before queueing."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def acquire_or_gone(
    sema: conch.aio.Semaphore, receive: Receive, timeout: float | None
) -> conch.aio.Hold | None:
    """Wait up to ``timeout`` seconds for a slot of ``sema`` while the client is there.

    Returns the Hold, or None if the client disconnected first: the acquire is cancelled,
    which withdraws our key (Lease.LeaseRevoke) before this returns; a slot granted in the
    same instant is released. Raises conch.NoSlot when time runs out, conch.Unavailable
    when etcd cannot be reached. If this task is cancelled itself (server shutdown), the
    acquire is withdrawn the same way before the cancellation propagates.
    """

    async def take() -> conch.aio.Hold:  # acquire() is an awaitable, not a coroutine
        return await sema.acquire(timeout=timeout)

    acquiring = asyncio.ensure_future(take())
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # On every way out (the client gone, or our own cancellation) but a slot granted
        # to a client still here: withdraw, and wait until the key is gone.
        client_here = not gone.done()
        gone.cancel()
        if not (client_here and acquiring.done()):
            await _withdraw(acquiring)
    if not client_here:
        return None
    return acquiring.result()  # the Hold, or NoSlot / Unavailable raised


async def _withdraw(acquiring: asyncio.Future[conch.aio.Hold]) -> None:
    acquiring.cancel()  # conch.aio deletes our key before the CancelledError leaves it
    await asyncio.wait({acquiring})
    if not acquiring.cancelled() and acquiring.exception() is None:
        await acquiring.result().release()  # granted before the cancel could stop it


class App:
    """The ASGI app: one conch.aio client, connected at lifespan startup, closed at
    shutdown."""

    def __init__(self) -> None:
        self.endpoints = os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379")
        self.name = os.environ.get("CONCH_EXAMPLE_NAME", "asgi-jobs")
        self.max = int(os.environ.get("CONCH_EXAMPLE_MAX", "1"))
        self.job_seconds = float(os.environ.get("CONCH_EXAMPLE_JOB", "0.2"))
        wait = os.environ.get("CONCH_EXAMPLE_WAIT", "")
        self.wait = float(wait) if wait else None
        self.ran_log = os.environ.get("CONCH_EXAMPLE_RAN")
        self.client: conch.aio.Client | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.http(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = await conch.aio.connect(self.endpoints, dial_timeout=5)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
        job_id = query.get("id", ["-"])[0]
        assert self.client is not None, "lifespan startup connects the client"
        sema = conch.aio.Semaphore(self.client, self.name, max=self.max, ttl=10)
        try:
            if scope["path"] == "/job":
                hold = await acquire_or_gone(sema, receive, self.wait)
                if hold is None:
                    return  # the client is gone, and so is our key: nothing to answer
            elif scope["path"] == "/job-naive":  # what happens without: the job runs anyway
                hold = await sema.acquire(timeout=self.wait)
            else:
                await respond(send, 404, "no such path\n")
                return
        except conch.NoSlot:
            await respond(send, 503, "no slot in time\n")
            return
        async with hold:
            await self.job(job_id)
        await respond(send, 200, f"ran {job_id}\n")

    async def job(self, job_id: str) -> None:
        if self.ran_log:
            with open(self.ran_log, "a") as ran:  # one short write; a real job would not block
                ran.write(f"{job_id}\n")
        await asyncio.sleep(self.job_seconds)


async def respond(send: Send, status: int, body: str) -> None:
    data = body.encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


app = App()
