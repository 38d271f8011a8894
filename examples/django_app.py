"""Django: at most N concurrent calls to a backend, across every replica, in a view.

A whole Django project in one file (settings, URLs, views), so that it runs as it is:

    CONCH_ENDPOINTS=127.0.0.1:2379 python examples/django_app.py runserver 8000   # WSGI
    CONCH_ENDPOINTS=127.0.0.1:2379 uvicorn examples.django_app:asgi_app          # ASGI
    CONCH_ENDPOINTS=... gunicorn -c examples/gunicorn_conf.py examples.django_app:wsgi_app  # WSGI

- ``/call`` (a sync view, for WSGI servers: runserver, gunicorn's sync or gthread workers)
  takes one of ``CONCH_EXAMPLE_MAX`` slots of ``CONCH_EXAMPLE_NAME`` with the threaded API,
  waits at most ``CONCH_EXAMPLE_WAIT`` seconds, and answers ``{"token": N}``, or 503 with
  ``Retry-After`` on ``conch.NoSlot``. One ``conch.Client`` per process, made on first use
  (``process_client``): after a pre-fork server's fork, each worker makes its own.
- ``/acall`` (an async view, for Django under an ASGI server) does the same with
  ``conch.aio``, on a client per event loop. Django (5.0 on) cancels an async view whose
  client disconnects; the cancel withdraws the waiting acquire's key before it propagates.

Django is not a dependency of conch.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

import conch
import conch.aio

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="conch-example-not-secret",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        INSTALLED_APPS=[],
        MIDDLEWARE=[],
    )
    django.setup()


def _setting(name: str, default: str) -> str:
    return os.environ.get(f"CONCH_EXAMPLE_{name}", default)


def semaphore_args() -> tuple[str, int, float]:
    """(name, max, wait seconds), read at each request so a test can change them."""
    return _setting("NAME", "billing"), int(_setting("MAX", "3")), float(_setting("WAIT", "10"))


_lock = threading.Lock()
_client: conch.Client | None = None
_client_pid = 0


def process_client() -> conch.Client:
    """This process's conch.Client, connected on first use (in a forked worker: its own)."""
    global _client, _client_pid
    with _lock:
        if _client is None or _client_pid != os.getpid():
            _client = conch.connect(os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379"))
            _client_pid = os.getpid()
        return _client


def close_process_client() -> None:
    """Close this process's client (a worker's exit): its holds are released."""
    global _client
    with _lock:
        client, _client = _client, None
    if client is not None and _client_pid == os.getpid():
        client.close()


def no_slot() -> HttpResponse:
    response = HttpResponse("no slot in time\n", status=503)
    response["Retry-After"] = "1"
    return response


def call(request: HttpRequest) -> HttpResponse:
    name, max_holders, wait = semaphore_args()
    sema = conch.Semaphore(process_client(), name, max=max_holders, ttl=3)
    try:
        with sema.acquire(timeout=wait) as hold:
            hold.check()  # right before acting as a holder
            return JsonResponse({"token": hold.revision})  # the call, fenced by the token
    except conch.NoSlot:
        return no_slot()


_aio_clients: dict[asyncio.AbstractEventLoop, conch.aio.Client] = {}


async def loop_client() -> conch.aio.Client:
    """A conch.aio.Client for the running loop, connected on first use."""
    loop = asyncio.get_running_loop()
    client = _aio_clients.get(loop)
    if client is None:
        client = await conch.aio.connect(os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379"))
        _aio_clients[loop] = client
    return client


async def acall(request: HttpRequest) -> HttpResponse:
    name, max_holders, wait = semaphore_args()
    sema = conch.aio.Semaphore(await loop_client(), name, max=max_holders, ttl=3)
    try:
        async with sema.acquire(timeout=wait) as hold:
            await hold.check()
            await asyncio.sleep(float(_setting("JOB", "0.05")))
            return JsonResponse({"token": hold.revision})
    except conch.NoSlot:
        return no_slot()


urlpatterns = [path("call", call), path("acall", acall)]


def __getattr__(name: str) -> Any:
    if name == "asgi_app":  # made on first use: a WSGI process never needs it
        from django.core.asgi import get_asgi_application

        return get_asgi_application()
    if name == "wsgi_app":  # gunicorn examples.django_app:wsgi_app
        from django.core.wsgi import get_wsgi_application

        return get_wsgi_application()
    raise AttributeError(name)


if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
