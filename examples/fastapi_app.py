"""FastAPI: at most N concurrent calls to a backend, across every replica, as a dependency.

``GET /call`` takes one of ``CONCH_EXAMPLE_MAX`` slots of ``CONCH_EXAMPLE_NAME`` for the
length of the handler (``CONCH_EXAMPLE_JOB`` seconds of work) and answers
``{"token": <fencing token>}``. It answers **503** (with ``Retry-After``) when no slot came
within ``CONCH_EXAMPLE_WAIT`` seconds (``conch.NoSlot``) and when the server shuts down
while the request waits; a request whose client disconnects while it waits withdraws its
key at once and runs nothing.

    CONCH_ENDPOINTS=127.0.0.1:2379 uvicorn examples.fastapi_app:app \
        --port 8080 --timeout-graceful-shutdown 1

Three pieces, each copyable on its own:

- ``lifespan``: one ``conch.aio`` client per process, connected at startup, closed at
  shutdown (after the requests have ended: the ``ShutdownAs503`` below).
- ``conch_slot``: the dependency. It races the acquire against the client's disconnect
  (``acquire_or_gone`` of examples/asgi_disconnect.py) and turns ``NoSlot`` into an
  ``HTTPException(503)``; the slot is released when the response is done (a dependency with
  ``yield``).
- ``ShutdownAs503``: uvicorn's graceful shutdown waits ``--timeout-graceful-shutdown``
  seconds for requests in flight, then cancels their tasks; a cancelled request would be
  uvicorn's HTTP 500. The cancel reaches the waiting acquire, which withdraws our key
  before it lets the ``CancelledError`` go (docs/embedding.md, "Cancellation"); this ASGI
  wrapper answers such a request 503 instead, if nothing of its answer was sent yet.

fastapi and uvicorn are not dependencies of conch.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request

import conch
import conch.aio
from examples.asgi_disconnect import acquire_or_gone

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

NAME = os.environ.get("CONCH_EXAMPLE_NAME", "billing")
MAX = int(os.environ.get("CONCH_EXAMPLE_MAX", "3"))
WAIT = float(os.environ.get("CONCH_EXAMPLE_WAIT", "10"))
JOB = float(os.environ.get("CONCH_EXAMPLE_JOB", "0.1"))
# A short TTL: a crashed replica's waiting keys block the slots they reach for one TTL.
TTL = int(os.environ.get("CONCH_EXAMPLE_TTL", "3"))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    endpoints = os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379")
    async with conch.aio.connect(endpoints, dial_timeout=5) as client:
        app.state.sema = conch.aio.Semaphore(client, NAME, max=MAX, ttl=TTL)
        app.state.waiting = set()
        yield
        # uvicorn sends the lifespan shutdown right after cancelling the requests still in
        # flight: let them withdraw their keys (and answer 503) before the client goes.
        if app.state.waiting:
            await asyncio.wait(set(app.state.waiting), timeout=5)


class ClientGone(Exception):
    """The client disconnected while its request waited: nothing to answer."""


async def conch_slot(request: Request) -> AsyncIterator[conch.aio.Hold]:
    """A slot of the app's semaphore for this request, released after the response."""
    sema: conch.aio.Semaphore = request.app.state.sema
    waiting: set[asyncio.Task[Any]] = request.app.state.waiting
    task = asyncio.current_task()
    assert task is not None
    waiting.add(task)
    try:
        hold = await acquire_or_gone(sema, request.receive, WAIT)
    except conch.NoSlot:
        raise HTTPException(503, "no slot in time", headers={"Retry-After": "1"}) from None
    finally:
        waiting.discard(task)
    if hold is None:
        raise ClientGone  # our key is already withdrawn
    async with hold:
        yield hold


fastapi_app = FastAPI(lifespan=lifespan)


@fastapi_app.exception_handler(ClientGone)
async def client_gone(request: Request, exc: ClientGone) -> None:
    return None  # nobody is there to read an answer


@fastapi_app.get("/call")
async def call(hold: Annotated[conch.aio.Hold, Depends(conch_slot)]) -> dict[str, int]:
    await hold.check()  # right before acting as a holder
    await asyncio.sleep(JOB)  # the call to the backend, with hold.revision as its fence
    return {"token": hold.revision}


class ShutdownAs503:
    """ASGI wrapper: a request cancelled by the server's shutdown answers 503, not 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            # The acquire under it has withdrawn its key already; answer, then end quietly.
            body = b"shutting down\n"
            headers = [(b"content-length", b"%d" % len(body)), (b"retry-after", b"1")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})


app = ShutdownAs503(fastapi_app)
