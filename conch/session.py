"""A session: one lease, kept alive, and the moment it is lost (contract section 3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from conch import log
from conch.errors import EtcdError, LeaseNotFound
from conch.etcd import lease
from conch.etcd.client import Client
from conch.flag import Flag


def keepalive_margin(ttl: float) -> float:
    """The grace, in seconds, beyond one keepalive interval before an unanswered keepalive
    counts as loss: small next to the TTL, so the child is stopped well before the lease
    can expire on the server."""
    return min(1.0, ttl / 6)


class Session:
    """One etcd lease of ``ttl`` seconds, refreshed on a LeaseKeepAlive stream every TTL/3.

    ``lost`` (a Flag) is set the moment it is no longer certain the lease is alive: etcd
    answers TTL <= 0, the stream breaks and cannot be re-opened in time, or no answer comes
    within one interval plus ``keepalive_margin``. Its ``reason`` says which. ``close()``
    revokes the lease so its keys go at once. Raises Unavailable (or another EtcdError) when
    LeaseGrant fails, Interrupted when ``interrupt`` is set while it retries.
    """

    def __init__(self, client: Client, ttl: int, interrupt: Flag | None = None) -> None:
        self._client = client
        asked = time.monotonic()
        granted = lease.grant(client, ttl, interrupt=interrupt)
        self.lease_id = granted.id
        self.ttl = granted.ttl
        self.interval = self.ttl / 3
        # etcd restarts the countdown when it receives a grant or keepalive, which is after
        # we sent it: so the lease is certainly alive until send time + TTL (monotonic).
        self.alive_until = asked + self.ttl
        self.lost = Flag("session-lost")
        self._keepalive_listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._keepalive = lease.KeepAlive(client, self.lease_id)
        self._thread = threading.Thread(target=self._run, name="conch-keepalive", daemon=True)
        self._thread.start()
        log.info("session", lease=f"{self.lease_id:x}", ttl=f"{self.ttl}s")
        if self.ttl != ttl:  # etcd's minimum TTL is 1.5 election timeouts, 2 s by default
            log.warning("ttl-raised", asked=f"{ttl}s", granted=f"{self.ttl}s", by="etcd")

    def _run(self) -> None:
        margin = keepalive_margin(self.ttl)
        next_send = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, next_send - time.monotonic())):
            sent = time.monotonic()
            try:
                ttl = self._keepalive.refresh(deadline=sent + self.interval + margin)
            except LeaseNotFound:
                self._declare_lost("lease expired or was revoked")
                return
            except EtcdError as exc:
                self._declare_lost(f"keepalive failed: {exc}")
                return
            self.alive_until = sent + ttl
            for listener in tuple(self._keepalive_listeners):
                listener()
            next_send = sent + self.interval

    def certainly_alive(self) -> bool:
        """Whether the lease is alive for sure now: not lost, and etcd's countdown from our
        last confirmed keepalive has not run out (a process frozen past its TTL fails this)."""
        return not self.lost.is_set() and time.monotonic() < self.alive_until

    @property
    def silence_limit(self) -> float:
        """Seconds without a confirmed keepalive after which a live session would surely have
        declared itself lost (two intervals plus two margins): the watchdog's deadline."""
        return 2 * self.interval + 2 * keepalive_margin(self.ttl)

    def on_keepalive(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` (from the keepalive thread) after every confirmed keepalive.
        Returns a function that removes it."""
        self._keepalive_listeners.append(listener)
        return lambda: self._keepalive_listeners.remove(listener)

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set():
            return
        self._keepalive.close()
        self.lost.set(reason)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke), waiting at most
        ``timeout`` seconds (default: the client's request timeout). Returns False when the
        revoke could not be confirmed (the lease then expires after its TTL)."""
        self._stop.set()
        try:
            lease.revoke(self._client, self.lease_id, timeout)
        except EtcdError as exc:
            log.warning("revoke-failed", lease=f"{self.lease_id:x}", error=str(exc))
            return False
        finally:
            # After the revoke, which is what a waiter waits for: the stream's teardown
            # would compete with it. A keepalive answered meanwhile changes nothing.
            self._keepalive.close()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=1.0)
        return True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
