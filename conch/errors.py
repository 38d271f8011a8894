"""conch's exceptions, and the one table (``EXIT_CODES``, contract section 8) that maps every
way conch ends (an ``Outcome``) to its exit code. Nothing else in conch spells one."""

from __future__ import annotations

import enum


class Outcome(enum.Enum):
    """How conch ends: ``value``, the event its log line is named for (where it has one), and
    ``code``, its exit code (None: the status given with it, the child's as a shell reports
    it, or ``signalled(S)`` = 128 + S for a signal S to a queued conch)."""

    code: int | None

    def __new__(cls, event: str, code: int | None) -> Outcome:
        outcome = object.__new__(cls)
        outcome._value_ = event
        outcome.code = code
        return outcome

    CHILD_EXITED = "child-exited", None  # the child ran to its end while the hold was kept
    SIGNAL = "signal", None  # a stop signal to conch while the child ran: the child terminated
    LOST_WHILE_RUNNING = "lost", 70  # the hold was lost (or its deadline came): killed
    NOT_FOUND = "child-not-found", 127  # the command was not found: nothing ran
    CANNOT_EXECUTE = "child-cannot-execute", 126  # found, but not executable
    WATCHDOG_FAILED = "watchdog-failed", 70  # no watchdog, or it died or went silent
    INTERNAL_ERROR = "internal-error", 70  # a bug of conch's: the child SIGKILLed first
    USAGE = "usage", 64  # bad flag, name, duration, credentials: nothing written to etcd
    UNAVAILABLE = "unavailable", 69  # etcd unreachable, or no session
    NO_SLOT = "timeout", 75  # --nonblock, or --wait ran out: our waiter key is gone
    INTERRUPTED = "interrupted", None  # a stop signal while queued: our waiter key is gone
    LISTED = "listed", 0  # --who: someone holds a slot
    NONE_HELD = "none-held", 1  # --who: nobody does


EXIT_CODES: dict[Outcome, int | None] = {outcome: outcome.code for outcome in Outcome}


def exit_code(outcome: Outcome, status: int | None = None) -> int:
    """The exit code of ``outcome`` (EXIT_CODES); ``status``: the one where it says None."""
    if outcome.code is not None:
        return outcome.code
    assert status is not None, outcome
    return status


def signalled(signum: int) -> int:
    """The status of a process ended by signal ``signum``, as a shell reports it."""
    return 128 + signum


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: the code, or 128 + S if killed by signal S."""
    return returncode if returncode >= 0 else signalled(-returncode)


class ConchError(Exception):
    """Base of every error conch raises on purpose: the command ends on it as ``outcome``,
    exiting with ``exit_code``."""

    outcome = Outcome.INTERNAL_ERROR  # a subclass's: ``class NoSlot(ConchError, outcome=...)``
    status: int | None = None

    def __init_subclass__(cls, outcome: Outcome | None = None) -> None:
        super().__init_subclass__()
        cls.outcome = outcome or cls.outcome

    @property
    def exit_code(self) -> int:
        return exit_code(self.outcome, self.status)


class UsageError(ConchError, outcome=Outcome.USAGE):
    """Bad input from the caller: flag, name, duration, capacity, missing command."""


class EtcdError(ConchError, outcome=Outcome.UNAVAILABLE):
    """etcd answered with an error conch does not handle itself; ``code``: gRPC status name."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class Unavailable(EtcdError):
    """No endpoint answered within the deadline (connection refused, timed out, no leader).
    ``code``: the gRPC status of the last failure (UNKNOWN for etcd's "context deadline
    exceeded"), UNAVAILABLE when conch gave up itself (a stream unanswered in time)."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message, code)


class PermissionDenied(EtcdError):
    """etcd refused the call for the authenticated user."""


class AuthenticationFailed(EtcdError, outcome=Outcome.USAGE):
    """etcd refused the user name or password: the caller's credentials are wrong."""


class TokenInvalid(EtcdError):
    """The auth token expired or went stale; the client authenticates again by itself."""


class LeaseNotFound(EtcdError):
    """The lease is unknown to etcd: it expired or was revoked."""


class Compacted(EtcdError):
    """The revision asked for was compacted away. ``compact_revision`` is the oldest one left."""

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message, "OUT_OF_RANGE")
        self.compact_revision = compact_revision


class SessionLost(ConchError, outcome=Outcome.LOST_WHILE_RUNNING):
    """The session's lease is no longer certainly alive (docs/failure-semantics.md)."""


class HoldLost(ConchError, outcome=Outcome.LOST_WHILE_RUNNING):
    """The hold is no longer certainly ours: the session's lease was lost or not confirmed
    within the TTL, or our key was seen deleted."""


class NoSlot(ConchError, outcome=Outcome.NO_SLOT):
    """No slot was free in time (``--nonblock`` or ``--wait`` ran out); our waiter key is gone."""

    @classmethod
    def in_time(cls, name: str, max: int, detail: str) -> NoSlot:
        """The wait for ``name``[``max``] ran out; ``detail`` (the waiting machine's ``no free
        slot in time[: <cause>]``) said once: ``no free slot of reports[2] in time: <cause>``."""
        cause = detail.removeprefix("no free slot in time")  # "" or ": <cause>"
        return cls(f"no free slot of {name}[{max}] in time{cause}")


class Interrupted(ConchError, outcome=Outcome.INTERRUPTED):
    """A signal asked us to stop while we were still queued; our waiter key is gone."""

    def __init__(self, signum: object) -> None:
        self.signum = signum if isinstance(signum, int) else 0
        # A library's interrupt Flag may carry a reason of its own ("shutdown"): say it.
        said = f"signal {signum}" if isinstance(signum, int) else str(signum or "interrupt")
        super().__init__(f"interrupted by {said}")
        self.status = signalled(self.signum)
