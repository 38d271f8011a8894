"""conch: flock(1) for a whole cluster, on etcd v3.

    conch sema NAME --max N -- CMD...

runs CMD only while holding one of N slots of the semaphore NAME, counted across every machine
that talks to the same etcd cluster, and kills CMD the moment the hold is lost.

The library under the command (timeouts in seconds, revisions as etcd numbers them)::

    import conch

    with conch.connect("10.0.0.1:2379,10.0.0.2:2379") as client:
        sema = conch.Semaphore(client, "reports", max=2, ttl=10)
        with sema.acquire(timeout=30) as hold:   # raises conch.NoSlot after 30 s
            hold.revision      # fencing token: our key's create_revision
            hold.lease_id      # the session's lease
            hold.lost          # a Flag: .is_set(), .wait(timeout); set when the hold is lost
            hold.on_lost(lambda reason: ...)
            hold.check()       # raises conch.HoldLost unless the hold is certainly ours now
            hold.put(key, value)   # a write that lands only while the slot is ours
            ...                # the critical section; leaving it after a loss raises HoldLost
        conch.who(client, "reports")   # [conch.Record, ...]

        with conch.Session(client, ttl=10) as session:   # one lease shared by several holds
            hold = sema.acquire(timeout=30, session=session)

asyncio has the same shape in ``conch.aio`` (``async with conch.aio.connect(...)``,
``async with sema.acquire(...)``). Embedding it in a service (threads, asyncio, pre-fork
servers, loss, fencing, shared sessions): docs/embedding.md.
Everything here is imported lazily, so ``import conch`` costs nothing until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ETCD_API_VERSION": "conch.etcd",
    "Client": "conch.etcd",
    "Endpoint": "conch.etcd",
    "connect": "conch.etcd.client",
    "TLS": "conch.etcd.client",
    "Credentials": "conch.etcd.client",
    "Semaphore": "conch.semaphore",
    "Hold": "conch.hold",
    "Identity": "conch.identity",
    "Record": "conch.listing",
    "who": "conch.listing",
    "Session": "conch.session",
    "Flag": "conch.flag",
    "supervise": "conch.supervisor",
    "ConchError": "conch.errors",
    "UsageError": "conch.errors",
    "EtcdError": "conch.errors",
    "Unavailable": "conch.errors",
    "PermissionDenied": "conch.errors",
    "AuthenticationFailed": "conch.errors",
    "TokenInvalid": "conch.errors",
    "LeaseNotFound": "conch.errors",
    "Compacted": "conch.errors",
    "SessionLost": "conch.errors",
    "NoSlot": "conch.errors",
    "HoldLost": "conch.errors",
    "Interrupted": "conch.errors",
}

__all__ = [
    "ETCD_API_VERSION",
    "TLS",
    "AuthenticationFailed",
    "Client",
    "Compacted",
    "ConchError",
    "Credentials",
    "Endpoint",
    "EtcdError",
    "Flag",
    "Hold",
    "HoldLost",
    "Identity",
    "Interrupted",
    "LeaseNotFound",
    "NoSlot",
    "PermissionDenied",
    "Record",
    "Semaphore",
    "Session",
    "SessionLost",
    "TokenInvalid",
    "Unavailable",
    "UsageError",
    "__version__",
    "connect",
    "supervise",
    "who",
]

if TYPE_CHECKING:
    from conch.errors import (
        AuthenticationFailed,
        Compacted,
        ConchError,
        EtcdError,
        HoldLost,
        Interrupted,
        LeaseNotFound,
        NoSlot,
        PermissionDenied,
        SessionLost,
        TokenInvalid,
        Unavailable,
        UsageError,
    )
    from conch.etcd import ETCD_API_VERSION, Client, Endpoint
    from conch.etcd.client import TLS, Credentials, connect
    from conch.flag import Flag
    from conch.hold import Hold
    from conch.identity import Identity
    from conch.listing import Record, who
    from conch.semaphore import Semaphore
    from conch.session import Session
    from conch.supervisor import supervise


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
