"""conch's exceptions, and the one table that maps them to exit codes (contract section 8)."""

from __future__ import annotations

EX_USAGE = 64
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70  # the hold was lost while the child ran
EX_TEMPFAIL = 75  # no slot
EX_CANNOT_EXECUTE = 126
EX_NOT_FOUND = 127


class ConchError(Exception):
    """Base of every error conch raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = EX_SOFTWARE


class UsageError(ConchError):
    """Bad input from the caller: flag, name, duration, capacity, missing command."""

    exit_code = EX_USAGE


class EtcdError(ConchError):
    """etcd answered with an error conch does not handle itself; ``code``: gRPC status name."""

    exit_code = EX_UNAVAILABLE

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class Unavailable(EtcdError):
    """No endpoint answered within the deadline (connection refused, timed out, no leader).
    ``code`` is the gRPC status of the last failure (UNAVAILABLE, DEADLINE_EXCEEDED, or
    UNKNOWN for etcd's "context deadline exceeded"); UNAVAILABLE when conch gave up itself
    (a stream without an answer in time)."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message, code)


class PermissionDenied(EtcdError):
    """etcd refused the call for the authenticated user."""


class AuthenticationFailed(EtcdError):
    """etcd refused the user name or password: the caller's credentials are wrong."""

    exit_code = EX_USAGE


class TokenInvalid(EtcdError):
    """The auth token expired or went stale; the client authenticates again by itself."""


class LeaseNotFound(EtcdError):
    """The lease is unknown to etcd: it expired or was revoked."""


class Compacted(EtcdError):
    """The revision asked for was compacted away. ``compact_revision`` is the oldest one left."""

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message, "OUT_OF_RANGE")
        self.compact_revision = compact_revision


class SessionLost(ConchError):
    """The session's lease is no longer certainly alive (contract section 3)."""

    exit_code = EX_SOFTWARE


class HoldLost(ConchError):
    """The hold is no longer certainly ours: the session's lease was lost (or its last
    confirmed keepalive is older than the TTL), or our key was seen deleted."""

    exit_code = EX_SOFTWARE


class NoSlot(ConchError):
    """No slot was free in time (``--nonblock`` or ``--wait`` ran out); our waiter key is gone."""

    exit_code = EX_TEMPFAIL

    @classmethod
    def in_time(cls, name: str, max: int, detail: str) -> NoSlot:
        """The wait for ``name``[``max``] ran out; ``detail`` is the waiting machine's
        account (``no free slot in time``, perhaps with ``: <cause>`` after it), said once:
        ``no free slot of reports[2] in time: <cause>``."""
        said = f"no free slot of {name}[{max}] in time"
        head, _, cause = detail.partition(": ")
        if head != "no free slot in time":
            cause = detail
        return cls(f"{said}: {cause}" if cause else said)


class Interrupted(ConchError):
    """A signal asked us to stop while we were still queued; our waiter key is gone."""

    def __init__(self, signum: object) -> None:
        self.signum = signum if isinstance(signum, int) else 0
        # A library's interrupt Flag may carry a reason of its own ("shutdown"): say it.
        said = f"signal {signum}" if isinstance(signum, int) else str(signum or "interrupt")
        super().__init__(f"interrupted by {said}")
        self.exit_code = 128 + self.signum
