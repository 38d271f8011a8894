"""What conch's machines and their drivers say to each other: etcd's data as the machines
see it, the inputs a driver feeds, the actions a machine asks for, and the outcomes.

Plain frozen records, no behaviour: ``conch.core.waiter`` decides with them, the codec
(``conch.core.codec``) turns actions into etcd requests and responses into inputs, and each
face executes them. docs/design.md ("The machine") tables what each input means and which
etcd call each action is.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias


@dataclass(frozen=True)
class KeyRev:
    """One key as a Range (keys only) or a watch event shows it: an event is a put (or,
    ``deleted``, a deletion) of ``key`` at ``mod_revision`` (a deletion's own revision)."""

    key: bytes
    create_revision: int  # ranks it in the queue
    mod_revision: int  # changes with every put (a touch)
    deleted: bool = False


class Failure(enum.Enum):
    """How a request failed, as the recipe needs to tell them apart."""

    UNREACHABLE = "unreachable"  # no answer in time, connection refused, no leader
    NO_SPACE = "no-space"  # etcd's space alarm: writes refused, reads and deletes served
    COMPACTED = "compacted"  # a read pinned to a revision compaction just passed
    LEASE_NOT_FOUND = "lease-not-found"  # our lease expired or was revoked
    OTHER = "other"  # anything else (permission denied, ...): given up, not retried


@dataclass(frozen=True)
class Tagged:
    """An action that asks, or an input that answers it under the action's ``id``."""

    id: int


# -- inputs: the action an answer answers names it; a ``revision`` is the header's ---------


@dataclass(frozen=True)
class SessionOpened(Tagged):
    lease_id: int  # the new lease
    key: bytes  # our key on it


@dataclass(frozen=True)
class EnqueueAnswer(Tagged):
    revision: int
    created: bool  # the put happened: ``standing`` says where our new key stands
    value: bytes = b""  # what our key holds (written, or found ours)
    standing: StandingAnswer | None = None  # read in the enqueue's Txn (None: read it)
    existing: KeyRev | None = None  # not created: the key in our place (None: deleted since)
    existing_ours: bool = False  # it is on our lease: an earlier attempt of ours went through


@dataclass(frozen=True)
class StandingAnswer(Tagged):
    revision: int
    window: Sequence[KeyRev]  # the first window_size(N) keys, ascending
    mine_and_prev: Sequence[KeyRev]  # the last two, descending (ours first, if still there)
    keys: int | None = None  # every key under the prefix, ours included, when counted


@dataclass(frozen=True)
class KeysAnswer(Tagged):
    kvs: Sequence[KeyRev | None]  # each key in the order asked, None when absent
    revision: int = 0  # the read's


@dataclass(frozen=True)
class TouchAnswer(Tagged):
    succeeded: bool  # false when our key is gone (the compare failed)


@dataclass(frozen=True)
class LeaseAnswer(Tagged):
    ttl: int  # seconds left, <= 0: gone


@dataclass(frozen=True)
class Over(Tagged):
    """The ``Pause`` with this id has run its length, or the ``Withdraw`` is over (confirmed
    or not: it is best effort, the lease expires anyway)."""


@dataclass(frozen=True)
class Failed(Tagged):
    failure: Failure  # the request failed so
    detail: str = ""  # how, for the log
    cause: object = None  # the driver's own (an exception), handed back in GaveUp.cause


@dataclass(frozen=True)
class Watched(Tagged):
    """A notice of watch ``id`` (docs/design.md): its ``events`` (in revision order),
    ``created`` (etcd confirmed it at ``revision``) or ``ended`` (``detail`` says why)."""

    events: Sequence[KeyRev] = ()
    revision: int = 0
    created: bool = False
    ended: bool = False
    detail: str = ""


@dataclass(frozen=True)
class DeadlineReached:
    """The caller's time to wait ran out (``timeout=0``: at once; we still try once)."""


@dataclass(frozen=True)
class SessionLost:
    """The session's lease is no longer certainly alive (the keepalive's verdict)."""

    reason: str = ""


@dataclass(frozen=True)
class Interrupt:
    """The caller asked us to stop waiting (a signal, a cancelled task)."""

    reason: object = None


# What answers a request of the main line, what the driver tells unasked, every input.
Answer: TypeAlias = SessionOpened | EnqueueAnswer | StandingAnswer | KeysAnswer | LeaseAnswer
Told: TypeAlias = DeadlineReached | SessionLost | Interrupt
Input: TypeAlias = Answer | TouchAnswer | Over | Failed | Watched | Told


# -- actions: each names its etcd call; conch.core.codec builds it -------------------------


@dataclass(frozen=True)
class OpenSession(Tagged):
    """Grant a new lease and keep it alive (private session only). Answer: SessionOpened,
    or Failed (UNREACHABLE: no session could be established)."""


@dataclass(frozen=True)
class SendEnqueue(Tagged):
    """KV.Txn: put our ``key`` (on ``lease_id``) if absent and read our standing, else Range
    ``key`` (``codec.enqueue_call``). Answer: EnqueueAnswer."""

    key: bytes
    lease_id: int


@dataclass(frozen=True)
class ReadStanding(Tagged):
    """Two Ranges read together of the keys up to our ``key`` created at ``revision``
    (``codec.standing_reads``). Answer: StandingAnswer."""

    key: bytes
    revision: int


@dataclass(frozen=True)
class ReadKeys(Tagged):
    """A Range per key, read together (closing the gap between a read and a watch's
    creation). Answer: KeysAnswer."""

    keys: Sequence[bytes]


@dataclass(frozen=True)
class OpenWatch(Tagged):
    """Watch.Watch from now (etcd's ``created`` answer wanted): with ``prefix``, the
    deletions (NOPUT filter) under the semaphore's prefix ``key``; else every change of the
    one ``key``. Answers: Watched; or Failed at once when the watch cannot be opened."""

    key: bytes
    prefix: bool


@dataclass(frozen=True)
class CancelWatch(Tagged):
    """Stop watch ``id`` (no answer)."""


@dataclass(frozen=True)
class Touch(Tagged):
    """KV.Txn: re-put our ``key`` (``value``, on ``lease_id``) if its create_revision is
    still ``revision``: the change wakes the waiter behind. Answer: TouchAnswer."""

    key: bytes
    revision: int
    value: bytes
    lease_id: int


@dataclass(frozen=True)
class CheckLease(Tagged):
    """Lease.LeaseTimeToLive of ``lease_id``. Answer: LeaseAnswer (or Failed)."""

    lease_id: int


@dataclass(frozen=True)
class Withdraw(Tagged):
    """Take our key out of the queue, best effort (WITHDRAW_TIMEOUT): with ``revoke``,
    Lease.LeaseRevoke of ``lease_id`` (a private session's close); else delete ``key`` by
    ``codec.withdraw_call``'s KV.Txn (by ``revision``, or by lease). Answer: Over."""

    key: bytes
    revision: int
    lease_id: int
    revoke: bool


@dataclass(frozen=True)
class Pause(Tagged):
    """Wait ``seconds`` (cut short by the deadline or an interrupt, which the driver feeds
    then), then feed Over(id)."""

    seconds: float


@dataclass(frozen=True)
class Note:
    """A log line: ``event`` with ``fields``; ``warning`` for the ones an operator should
    see in quiet mode too. No answer."""

    event: str
    fields: Mapping[str, object] = field(default_factory=dict)
    warning: bool = False


# The requests of the waiter's main line (one at a time), and every action.
Request: TypeAlias = OpenSession | SendEnqueue | ReadStanding | ReadKeys | CheckLease | Withdraw
Action: TypeAlias = Request | OpenWatch | CancelWatch | Touch | Pause | Note


# -- outcomes ------------------------------------------------------------------------------


class TouchOwed(enum.Enum):
    """What the new holder owes the waiter behind it, which may be asleep watching our key."""

    NONE = "none"  # we touched while waiting, or held from our key's creation
    AT_ONCE = "at-once"  # N > 1: another holder may leave any moment; touch now
    LATER = "later"  # N = 1: touch a little into the hold (guard.TOUCH_DELAY)


@dataclass(frozen=True)
class Held:
    """We hold a slot; ``key`` and ``lease_id`` as held (a private session may have been
    re-opened on the way)."""

    key: bytes
    lease_id: int
    revision: int  # our key's create_revision: the fencing token
    held_at: int  # a revision at which it was seen holding
    value: bytes
    touch: TouchOwed
    retire: Sequence[int] = ()  # watches left open (that woke us): cancel off the handoff's path


class Reason(enum.Enum):
    """Why a waiter gave up; our key is gone (withdrawn) in every case."""

    NO_SLOT = "no-slot"  # the deadline came first (NoSlot, exit 75)
    INTERRUPTED = "interrupted"  # Interrupt (Interrupted, exit 128 + signal)
    SESSION_LOST = "session-lost"  # a shared session was lost (SessionLost)
    UNAVAILABLE = "unavailable"  # no session could be established at all (exit 69)
    REFUSED = "refused"  # etcd refused a request for good (Failure.OTHER)


@dataclass(frozen=True)
class GaveUp:
    """We do not hold, and our key is withdrawn: ``reason`` and a line for people.
    ``cause``: Interrupt.reason for INTERRUPTED, the Failed input for UNAVAILABLE and
    REFUSED (its own ``cause`` is the driver's exception)."""

    reason: Reason
    detail: str = ""
    cause: object = None


Outcome: TypeAlias = Held | GaveUp
