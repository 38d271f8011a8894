"""The hold's guard: when a held slot's guard touches and watches, and what it saw means.

Pure decisions, no I/O: the Hold of each face (``conch/hold.py``, ``conch/aio/hold.py``)
makes the calls and keeps the time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from conch.core.messages import KeyRev, TouchOwed

# -- the hold's guard ----------------------------------------------------------------------
# Once a slot is ours, the Hold (conch/hold.py, and the asyncio face's) guards it: it
# watches our key for deletion and owes the waiter behind it the touch. Its decisions, as
# pure functions of what it saw; the Hold does the calls and keeps the time.

# Seconds into the guard before it opens the watch on our own key: a short job is over by
# then and never pays for that watch, whose set-up would compete with its release. A
# deletion in between is not missed (the watch starts from where we held), only noticed
# later; a lost session is noticed at once.
GUARD_WATCH_DELAY = 0.05
# Seconds into a hold at max 1 before its touch (TouchOwed.LATER). A job that ends just as
# it is made pays the most: the touch and the next waiter's move-up compete with its
# release (about 3 ms more at that handoff, measured), small next to half a second; a
# shorter job never pays for that write.
TOUCH_DELAY = 0.5


@dataclass(frozen=True)
class GuardPlan:
    """When the guard does what: ``touch_at_once`` (as the Hold is made, before its guard
    starts: the supervisor starts that only after its spawn); ``touch_after`` seconds into
    the guard (None: no touch then); the watch on our key ``watch_after`` seconds into the
    guard."""

    touch_at_once: bool
    touch_after: float | None
    watch_after: float


def guard_plan(owed: TouchOwed) -> GuardPlan:
    """The guard's schedule for a hold that owes ``owed``."""
    return GuardPlan(
        touch_at_once=owed == TouchOwed.AT_ONCE,
        touch_after=TOUCH_DELAY if owed == TouchOwed.LATER else None,
        watch_after=GUARD_WATCH_DELAY,
    )


class GuardVerdict(enum.Enum):
    """What something the guard saw means."""

    NOTHING = "nothing"  # released (or releasing), or lost already: nothing left to guard
    LOST = "lost"  # our key is gone: the hold is lost
    LOOK = "look"  # the watch ended (compacted, stream gave up): read our key after a pause
    WATCH = "watch"  # our key is still ours: watch it from the read's revision on
    RETRY = "retry"  # etcd did not answer: try the same call again after a pause


def guard_on_notice(done: bool, ended: bool) -> GuardVerdict:
    """A notice of the watch on our key (deletions only): an event is our key's deletion
    (lease revoked or expired, or by hand); ``ended``, the watch is over and says nothing
    of our key. Whether the session is lost is the keepalive's call, not this."""
    if done:
        return GuardVerdict.NOTHING
    return GuardVerdict.LOOK if ended else GuardVerdict.LOST


def guard_on_look(done: bool, found: KeyRev | None, revision: int) -> GuardVerdict:
    """A Range of our key (``found``, None when absent): still ours only if its
    create_revision is still ``revision`` (the fencing token)."""
    if done:
        return GuardVerdict.NOTHING
    if found is None or found.create_revision != revision:
        return GuardVerdict.LOST
    return GuardVerdict.WATCH


def guard_on_touch(done: bool, succeeded: bool | None) -> GuardVerdict:
    """A touch's answer: ``succeeded`` (the compare on our create_revision held), False
    (our key is gone), None (no answer: etcd away, or refusing writes under its space
    alarm; the hold is not lost for that)."""
    if done:
        return GuardVerdict.NOTHING
    if succeeded is None:
        return GuardVerdict.RETRY
    return GuardVerdict.WATCH if succeeded else GuardVerdict.LOST
