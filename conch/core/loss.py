"""Why a session or a hold was lost: a ``Loss`` is a ``str`` (the message: ``hold.reason``,
``session.reason``, what ``on_lost(callback)`` is given) carrying ``reason``, a LossReason,
which code deciding by it (the supervisor: SIGKILL at once, or a grace?) compares, never
the message's words."""

from __future__ import annotations

import enum


class LossReason(enum.Enum):
    """What ended a session or a hold, by what etcd (or our own clock) said."""

    # E passed, no later keepalive confirmed: the lease may be gone, or outlived etcd's outage.
    NO_KEEPALIVE = "no-keepalive-confirmed"
    LEASE_NOT_FOUND = "lease-not-found"  # a keepalive's TTL <= 0: expired or revoked
    # Our key is gone while the lease lives (a watch event, a look at the key, a failed
    # compare on our create_revision): deleted by hand, or the lease's expiry seen first.
    KEY_DELETED = "key-deleted"
    SESSION_CLOSED = "session-closed"  # by close(), the client's close(), a drop: under a hold
    STALLED = "stalled"  # the wrapper stalled past its deadline: its watchdog killed the child

    @property
    def slot_taken(self) -> bool:
        """Whether this loss was seen in etcd itself, so that the slot may already be
        someone else's (a grace for the child would be spent beside its new holder): our
        lease or key is gone, or the session was closed under the hold. Not NO_KEEPALIVE:
        the lease then lives at least until E, which the child's deadline is planned from."""
        return self not in (LossReason.NO_KEEPALIVE, LossReason.STALLED)


class Loss(str):
    """A loss: its message (``str(loss)``, what is logged and shown) and its ``reason``:
    ``Loss(LossReason.KEY_DELETED, "our key was deleted")``. ``Loss.of(obj)`` reads the
    reason back from whatever a Flag was set with."""

    reason: LossReason

    def __new__(cls, reason: LossReason, message: str) -> Loss:
        loss = super().__new__(cls, message)
        loss.reason = reason
        return loss

    def __reduce__(self) -> tuple[object, ...]:
        return (Loss, (self.reason, str(self)))

    def within(self, prefix: str) -> Loss:
        """The same loss, its message prefixed (``"session lost: "``: the hold's session's)."""
        return Loss(self.reason, f"{prefix}{self}")

    @staticmethod
    def of(said: object) -> LossReason | None:
        """The LossReason carried by ``said`` (a Loss), None for anything else."""
        return said.reason if isinstance(said, Loss) else None


# The messages conch gives each loss (``str(loss)``), as they have always read.
LEASE_GONE = Loss(LossReason.LEASE_NOT_FOUND, "lease expired or was revoked")
KEY_GONE = Loss(
    LossReason.KEY_DELETED, "our key was deleted (lease revoked or expired, or by hand)"
)
KEY_GONE_WRITE = Loss(LossReason.KEY_DELETED, "our key was deleted (found by a guarded write)")
NOT_CONFIRMED = Loss(LossReason.NO_KEEPALIVE, "no keepalive confirmed within the TTL")
CLOSED = Loss(LossReason.SESSION_CLOSED, "session closed")
