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

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module it is imported from on first use.
_EXPORTS = {
    name: module
    for module, names in {
        "conch.etcd": "ETCD_API_VERSION Client Endpoint",
        "conch.etcd.client": "connect TLS Credentials",
        "conch.semaphore": "Semaphore",
        "conch.hold": "Hold",
        "conch.identity": "Identity",
        "conch.listing": "Record who",
        "conch.session": "Session",
        "conch.flag": "Flag",
        "conch.supervisor": "supervise",
        "conch.errors": "ConchError UsageError EtcdError Unavailable PermissionDenied "
        "AuthenticationFailed TokenInvalid LeaseNotFound Compacted SessionLost NoSlot "
        "HoldLost Interrupted",
    }.items()
    for name in names.split()
}

__all__ = sorted([*_EXPORTS, "__version__"], key=lambda n: (not n.isupper(), n[0].islower(), n))

if TYPE_CHECKING:  # "X as X": the names are conch's own (mypy's explicit re-export)
    from conch.errors import AuthenticationFailed as AuthenticationFailed
    from conch.errors import Compacted as Compacted
    from conch.errors import ConchError as ConchError
    from conch.errors import EtcdError as EtcdError
    from conch.errors import HoldLost as HoldLost
    from conch.errors import Interrupted as Interrupted
    from conch.errors import LeaseNotFound as LeaseNotFound
    from conch.errors import NoSlot as NoSlot
    from conch.errors import PermissionDenied as PermissionDenied
    from conch.errors import SessionLost as SessionLost
    from conch.errors import TokenInvalid as TokenInvalid
    from conch.errors import Unavailable as Unavailable
    from conch.errors import UsageError as UsageError
    from conch.etcd import ETCD_API_VERSION as ETCD_API_VERSION
    from conch.etcd import Client as Client
    from conch.etcd import Endpoint as Endpoint
    from conch.etcd.client import TLS as TLS
    from conch.etcd.client import Credentials as Credentials
    from conch.etcd.client import connect as connect
    from conch.flag import Flag as Flag
    from conch.hold import Hold as Hold
    from conch.identity import Identity as Identity
    from conch.listing import Record as Record
    from conch.listing import who as who
    from conch.semaphore import Semaphore as Semaphore
    from conch.session import Session as Session
    from conch.supervisor import supervise as supervise


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
