"""A caller of the public API as a typed service writes it: checked by mypy --strict (the
project's mypy runs over tests/), and run by test_embedding against a real etcd."""

from __future__ import annotations

import asyncio

import conch


def guarded_job(endpoints: str, name: str, loop: asyncio.AbstractEventLoop) -> int:
    """Hold one slot of ``name``, record the fencing token under a guarded write, and tell
    ``loop`` of a loss the way an asyncio service does. Returns the token."""
    tls: conch.TLS | None = None
    credentials: conch.Credentials | None = None
    lost = asyncio.Event()
    with conch.connect(endpoints, dial_timeout=5.0, tls=tls, credentials=credentials) as client:
        sema = conch.Semaphore(client, name, max=1, ttl=5)
        try:
            with sema.acquire(timeout=10.0) as hold:
                # call_soon_threadsafe returns a Handle: on_lost takes any result.
                hold.on_lost(lambda reason: loop.call_soon_threadsafe(lost.set))
                hold.check()
                token: int = hold.revision
                hold.put(f"/app/{name}/token", str(token))
                hold.delete(f"/app/{name}/token")
                return token
        except conch.HoldLost:
            raise
        except (conch.AuthenticationFailed, conch.TokenInvalid, conch.Unavailable) as exc:
            code: str = exc.code
            raise RuntimeError(code) from exc
