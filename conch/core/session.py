"""The session as a machine: one lease's keepalive schedule, its earliest expiry E, and
the loss decision (docs/failure-semantics.md, "The loss rule"). No I/O, no threads, no
clock: the driver (``conch.session.Keeper``, the simulator) passes ``now``
(``time.monotonic()`` seconds) into every step and executes the actions it is given."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conch.core.loss import LEASE_GONE, NOT_CONFIRMED, Loss
from conch.errors import EtcdError, LeaseNotFound

# Keepalives go up to this much (or an eighth of the interval) early, on a grid of that step:
# a client's sessions send in bursts served in one wake-up (each deadline counts from its send).
SEND_GRID = 0.5  # seconds

# The pause before an unanswered keepalive is sent again, doubling up to the cap.
KEEPALIVE_RETRY = 0.25  # seconds
KEEPALIVE_RETRY_CAP = 1.0  # seconds


def keepalive_margin(ttl: float) -> float:
    """The grace, in seconds, beyond one keepalive interval that a keepalive is given to be
    answered (its deadline is its send time + TTL/3 + this): small next to the TTL."""
    return min(1.0, ttl / 6)


@dataclass(frozen=True)
class SendKeepalive:
    """Send one keepalive now (Lease.LeaseKeepAlive); unanswered if not by ``deadline``."""

    deadline: float


@dataclass(frozen=True)
class WakeAt:
    """Call ``wake(now)`` at ``at``; replaces any WakeAt given before."""

    at: float


@dataclass(frozen=True)
class Expired:
    """E passed unconfirmed (once per E; LossReason.NO_KEEPALIVE): holds are lost with
    ``loss``, waiters carry on. ``lost``: etcd said the lease is gone (TTL <= 0:
    LossReason.LEASE_NOT_FOUND): the session is lost with ``loss``; nothing follows."""

    loss: Loss
    lost: bool = False


SessionAction = SendKeepalive | WakeAt | Expired


class SessionMachine:
    """One lease of ``ttl`` seconds, granted by a LeaseGrant sent at ``granted_at``. The
    drivers read ``ttl``, ``interval`` (TTL/3: a keepalive is due one interval after the last
    confirmed one was sent), ``alive_until`` (E), ``lost`` (the Loss, once etcd says the
    lease is gone) and ``closed``."""

    def __init__(self, ttl: int, granted_at: float) -> None:
        self.ttl = ttl
        self.interval = ttl / 3
        self.alive_until = granted_at + ttl
        self.lost: Loss | None = None
        self.closed = False
        self._send = self._on_grid(granted_at + self.interval)  # the next keepalive
        self._in_flight = False  # a keepalive sent, its answer not in yet
        self._expiry_told = False  # Expired given for this alive_until
        self._retry = KEEPALIVE_RETRY

    @property
    def done(self) -> bool:
        """Lost or closed: the machine asks for nothing more."""
        return self.lost is not None or self.closed

    def certainly_alive(self, now: float) -> bool:
        """Whether the lease is alive for sure at ``now``: not lost, not closed, before E."""
        return not self.done and now < self.alive_until

    def start(self) -> list[SessionAction]:
        """The first wake-up: the first keepalive, one interval after the grant."""
        return self._wake_after()

    def wake(self, now: float) -> list[SessionAction]:
        """A WakeAt came due: tell E's passing, send the keepalive due, wake again."""
        if self.done:
            return []
        actions: list[SessionAction] = []
        if not self._expiry_told and now >= self.alive_until:
            self._expiry_told = True
            actions.append(Expired(NOT_CONFIRMED))
        if not self._in_flight and now >= self._send:
            self._in_flight = True
            actions.append(SendKeepalive(now + self.interval + keepalive_margin(self.ttl)))
        return [*actions, *self._wake_after()]

    def settle(self, sent: float, now: float, outcome: float | EtcdError) -> list[SessionAction]:
        """What the keepalive sent at ``sent`` came to, at ``now``: a TTL (> 0) moves E to
        ``sent + ttl`` and the next keepalive to one interval after ``sent``; LeaseNotFound
        (etcd said TTL <= 0) loses the session; another EtcdError (no answer by its deadline,
        a refusal) loses nothing: the keepalive is sent again after a pause."""
        self._in_flight = False
        if self.done:
            return []
        if isinstance(outcome, LeaseNotFound):
            self.lost = LEASE_GONE
            return [Expired(LEASE_GONE, lost=True)]
        if isinstance(outcome, EtcdError):
            self._send = now + self._retry
            self._retry = min(self._retry * 2, KEEPALIVE_RETRY_CAP)
            return self._wake_after()
        self._retry = KEEPALIVE_RETRY
        if sent + outcome > self.alive_until:
            self.alive_until = sent + outcome
            self._expiry_told = False
        self._send = self._on_grid(sent + self.interval)
        return self._wake_after()

    def close(self) -> None:
        """The session is being closed (its lease revoked): ask for nothing more."""
        self.closed = True

    def _on_grid(self, due: float) -> float:
        step = min(SEND_GRID, self.interval / 8)
        return due - due % step

    def _wake_after(self) -> list[SessionAction]:
        at = math.inf if self._in_flight else self._send
        if not self._expiry_told:
            at = min(at, self.alive_until)
        return [] if at == math.inf else [WakeAt(at)]
