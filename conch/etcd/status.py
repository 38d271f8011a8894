"""The etcd release each endpoint runs, from Maintenance.Status, asked once per client and
endpoint: the read plan (``conch.core.codec.read_plan``) depends on it, since some releases
crash on a read-only Txn whose deadline passes."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError, Interrupted
from conch.etcd.client import Client, Endpoint
from conch.flag import Flag
from conch.timer import PerOwner

# Seconds before an endpoint whose Status failed is asked again (until then its release is
# not known, and reads take the plan that is safe on every release).
ASK_AGAIN_AFTER = 10.0
_STATUS = rpc_pb2.StatusRequest()  # never changed


class _Versions:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # one Status at a time per client on threads
        self.known: dict[Endpoint, tuple[str | None, float]] = {}  # None: Status failed then
        self.asking: dict[tuple[Endpoint, asyncio.AbstractEventLoop], asyncio.Task[str | None]] = {}

    def remembered(self, endpoint: Endpoint) -> tuple[bool, str | None]:
        """(whether to answer from memory, the version remembered)."""
        version, at = self.known.get(endpoint, (None, -math.inf))
        return version is not None or time.monotonic() - at < ASK_AGAIN_AFTER, version

    def learn(self, endpoint: Endpoint, response: rpc_pb2.StatusResponse | None) -> str | None:
        version = None if response is None else str(response.version)
        if self.known.get(endpoint, (None, 0.0))[0] is None:  # a release once known stays
            self.known[endpoint] = (version, time.monotonic())
        return version


_versions: PerOwner[Client, _Versions] = PerOwner(lambda _client: _Versions())


def server_version(client: Client, interrupt: Flag | None = None) -> str | None:
    """The etcd release of the endpoint ``client`` calls now ("3.5.1", Maintenance.Status's
    ``version``, one Status at a time per client within its request timeout), remembered for
    the client's life; None when Status failed (asked again ASK_AGAIN_AFTER seconds later).
    Raises Interrupted when ``interrupt`` ends the Status's retries."""
    versions = _versions(client)
    endpoint = client.endpoint
    with versions.lock:
        known, version = versions.remembered(endpoint)
        if known:
            return version
        response = None
        with contextlib.suppress(EtcdError):
            response = client.call("maintenance", "Status", _STATUS, interrupt=interrupt)
        return versions.learn(endpoint, response)


async def server_version_async(
    client: Client, interrupt: asyncio.Event | None = None
) -> str | None:
    """``server_version`` for coroutines: those of one loop that find the release not known
    await one Status (``call_async``). Interrupted when ``interrupt`` is set (that one only)."""
    versions = _versions(client)
    endpoint = client.endpoint
    known, version = versions.remembered(endpoint)
    if known:
        return version
    loop = asyncio.get_running_loop()
    asking = versions.asking.get((endpoint, loop))
    if asking is None:
        asking = loop.create_task(_ask(client, versions, endpoint))
        versions.asking[(endpoint, loop)] = asking
        asking.add_done_callback(lambda _task: versions.asking.pop((endpoint, loop), None))
    stop = loop.create_future() if interrupt is None else loop.create_task(interrupt.wait())
    try:
        await asyncio.wait([asking, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not asking.done():
        raise Interrupted("interrupted")
    return asking.result()


async def _ask(client: Client, versions: _Versions, endpoint: Endpoint) -> str | None:
    response = None
    with contextlib.suppress(EtcdError):
        response = await client.call_async("maintenance", "Status", _STATUS)
    return versions.learn(endpoint, response)
