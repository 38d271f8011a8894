"""The hold's guard: when a held slot's guard touches and watches, what it saw means, what
it logs. No I/O, no clock: ``GuardMachine`` is the whole guard; each face's Hold
(``conch/hold.py``, ``conch/aio/hold.py``) executes its actions, feeding back their answers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from conch.core.loss import KEY_GONE, KEY_GONE_WRITE, Loss, LossReason
from conch.core.messages import KeyRev, Note, TouchOwed

# Seconds into the guard before it opens the watch on our own key (a short job never pays
# for it; a deletion in between is noticed later, not missed: docs/design.md).
GUARD_WATCH_DELAY = 0.05
# Seconds into a hold at max 1 before its touch (TouchOwed.LATER): a shorter job never pays
# for that write (docs/design.md).
TOUCH_DELAY = 0.5


class GuardStep(enum.Enum):
    """A step of the guard: due after a ``GuardAfter``, made as a ``GuardCall``."""

    WATCH_OWN_KEY = "watch-own-key"  # retire the waiting watch, watch our key
    TOUCH_AT_ONCE = "touch-at-once"  # the touch owed as the hold is made
    TOUCH_DUE = "touch-due"  # the touch owed TOUCH_DELAY into a max-1 hold
    LOOK = "look"  # read our key (after a watch that ended or could not open)


@dataclass(frozen=True)
class GuardAfter:
    """In ``seconds``, feed ``step(step)`` (skipped if the guard is done by then)."""

    seconds: float
    step: GuardStep


@dataclass(frozen=True)
class GuardCall:
    """A call to etcd, by ``step``. A touch: re-put our key if its create_revision is still
    ours (one KV.Txn, the value on our lease); answer ``touched(step, revision, succeeded)``
    or ``touch_failed(step, detail)``. LOOK: Range our key; answer ``looked(found,
    revision)`` (found None when absent; the header's revision), ``watch_failed()`` without
    one. WATCH_OWN_KEY: cancel the guard's watches, watch our key's deletions from revision
    ``start``; ``watch_failed()`` if it cannot be opened, its notices to ``notice(ended)``."""

    step: GuardStep
    start: int = 0


# A Loss: the hold is lost with it (the Hold sets its loss, cancels its watches).
GuardAction: TypeAlias = GuardAfter | GuardCall | Loss | Note


class GuardMachine:
    """The guard of one held slot: our key at create_revision ``revision`` (the fencing
    token), seen ours and holding at ``held_at``, owing the waiter behind it ``owed``, its
    pauses' seconds from ``pauses()`` (``conch.etcd.client.Backoff.next``: capped). Each
    input (method) returns the actions to execute; once ``done`` (released, or lost), none
    but the notes already due."""

    def __init__(
        self, owed: TouchOwed, revision: int, held_at: int, pauses: Callable[[], float]
    ) -> None:
        self._owed = owed
        self.revision = revision
        # Our key seen ours and holding at this revision: the guard watches from there (from
        # our create_revision, etcd would replay a long wait's history, or refuse it compacted).
        self.held_at = held_at or revision
        self.releasing = False
        self.lost: Loss | None = None
        self._pauses = pauses
        self.started = False  # whether start() was fed (the guard's watch is due or open)
        self._watches_own_key = False  # the guard's own watch opened (or tried)
        self._touch_failing = False  # "touch-failed" said for the failures in a row now

    @property
    def done(self) -> bool:
        """Nothing left to guard: released (or releasing), or lost."""
        return self.releasing or self.lost is not None

    def made(self) -> list[GuardAction]:
        """The hold is made. One that owes its touch at once touches now: another holder may
        leave any moment, and the waiter behind us must learn now, not once the guard starts
        (after the supervisor's spawn), that it is in the window, to watch for it."""
        return [GuardAfter(0.0, GuardStep.TOUCH_AT_ONCE)] if self._owed == TouchOwed.AT_ONCE else []

    def start(self) -> list[GuardAction]:
        """Start guarding (idempotent): the watch on our key GUARD_WATCH_DELAY in."""
        if self.started or self.done:
            return []
        self.started = True
        return [GuardAfter(GUARD_WATCH_DELAY, GuardStep.WATCH_OWN_KEY)]

    def release(self) -> None:
        """The hold is being released: the deletion that follows is no loss."""
        self.releasing = True

    def session_ended(self, loss: Loss, lost: bool = False) -> list[GuardAction]:
        """E passed with no keepalive confirmed (the hold can no longer promise it is ours),
        or, ``lost``, the session said its lease is gone (or the session ended): the hold is
        lost with ``loss`` (the two as the session machine's ``Expired`` carries them)."""
        return self._lose(loss.within("session lost: ") if lost else loss)

    def write_refused(self) -> list[GuardAction]:
        """A guarded write's compare on our create_revision failed: our key is gone."""
        return self._lose(KEY_GONE_WRITE)

    def step(self, step: GuardStep) -> list[GuardAction]:
        """A GuardAfter came due."""
        if self.done:
            return []
        if step != GuardStep.WATCH_OWN_KEY:
            return [GuardCall(step)]
        self._watches_own_key = True
        watch = GuardCall(step, self.held_at + 1)
        if self._owed != TouchOwed.LATER:
            return [watch]
        return [GuardAfter(TOUCH_DELAY - GUARD_WATCH_DELAY, GuardStep.TOUCH_DUE), watch]

    def watch_failed(self) -> list[GuardAction]:
        """The watch on our key could not be opened (or a Range of it had no answer): look
        at the key after a pause."""
        return [] if self.done else [GuardAfter(self._pauses(), GuardStep.LOOK)]

    def notice(self, ended: bool) -> list[GuardAction]:
        """A notice of the watch on our key (deletions only): an event is our key's deletion
        (lease revoked or expired, or by hand); ``ended`` (compacted, stream gave up) says
        nothing of it: look after a pause (the session's loss is the keepalive's call)."""
        return self.watch_failed() if ended else self._lose(KEY_GONE)

    def looked(self, found: KeyRev | None, revision: int) -> list[GuardAction]:
        """What a Range of our key found (None when absent) at header revision ``revision``:
        ours only if its create_revision is. Only a release makes its absence no loss."""
        if found is None or found.create_revision != self.revision:
            return self._lose(Loss(LossReason.KEY_DELETED, "our key was deleted"))
        return [] if self.done else [GuardCall(GuardStep.WATCH_OWN_KEY, revision + 1)]

    def touched(self, step: GuardStep, revision: int, succeeded: bool) -> list[GuardAction]:
        """A touch's answer at ``revision``: unless ``succeeded``, our key is gone (lost)."""
        self._touch_failing = False
        if not succeeded:
            return self._lose(KEY_GONE)
        if step == GuardStep.TOUCH_AT_ONCE and not self._watches_own_key:
            self.held_at = max(self.held_at, revision)  # ours at the touch: nothing before
        return []

    def touch_failed(self, step: GuardStep, detail: str) -> list[GuardAction]:
        """No answer to a touch (etcd away), or a refusal (its space alarm): no loss; retried
        after a pause. Said once per run of failures: the alarm may last hours."""
        said: list[GuardAction] = []
        if not self._touch_failing:
            said.append(Note("touch-failed", {"error": detail}, warning=True))
        self._touch_failing = True
        return said if self.done else [*said, GuardAfter(self._pauses(), step)]

    def _lose(self, loss: Loss) -> list[GuardAction]:
        if self.done:
            return []
        self.lost = loss
        return [loss]
