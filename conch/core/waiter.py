"""The waiting recipe as a pure state machine (as h11 is HTTP's): inputs in, actions out; no
sockets, threads, clock or gRPC. A ``Waiter`` is one acquire of one semaphore: docs/design.md
("Waiting", "The machine") draws its states, tables its inputs and actions and shows its
driver's loop. Time reaches it only as inputs (``DeadlineReached``, ``Over``). Actions are
executed in the order given: the one on the handoff's path comes first. Once a slot is held,
the Hold's guard decides (``conch.core.guard``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from typing import Protocol

from conch.core import messages as m
from conch.core.messages import Failure, KeyRev, Reason, TouchOwed

# Waiters in the window beyond the N holders, at most: each release wakes them all (one
# watch event each), so their number stays small whatever the max.
WINDOW_WAITERS_CAP = 8


def window_size(max_holders: int) -> int:
    """How many keys, from the first by create_revision, the window holds: the holders and
    up to N + 1 waiters (capped), so that N releases in a row still find a waiter in the
    window for each slot before the one behind has joined it."""
    return max_holders + min(max_holders + 1, WINDOW_WAITERS_CAP)


class PauseSource(Protocol):
    """A ``Pause``'s length in seconds: ``conch.etcd.client.Backoff`` (capped, jittered)."""

    def next(self) -> float: ...

    def reset(self) -> None: ...


class State(enum.Enum):
    """Where a Waiter is, named as docs/design.md names it."""

    OPENING = "opening"  # a private session's lease being granted
    ENQUEUEING = "enqueueing"  # our key's create-if-absent Txn sent
    SPREAD_BUSY = "spread-busy"  # --spread: our host's key held by another process
    READING = "reading"  # reading our standing (or checking a gap, or our lease)
    IN_WINDOW = "in-window"  # counting the deletions ahead of us under the prefix
    BEHIND = "behind"  # watching our immediate predecessor
    PAUSED = "paused"  # etcd away or refusing writes, or before re-entering
    HELD = "held"  # done: outcome is Held
    WITHDRAWING = "withdrawing"  # giving up: our key being taken out
    DONE = "done"  # done: outcome is GaveUp


_WAITING = (State.IN_WINDOW, State.BEHIND, State.SPREAD_BUSY)
_GONE = "our key is gone (lease expired or key deleted)"

Step = Callable[[], list[m.Action]]


class Waiter:
    """One acquire of the semaphore whose keys live under ``prefix`` (``max_holders`` slots).

    Without ``key`` and ``lease_id`` it runs on a private session: it opens one
    (``OpenSession``), withdraws by revoking it, and when its place is lost (our key gone,
    the session lost) re-enters at the back of the queue with a new one. With them, on the
    caller's shared session: it withdraws by deleting its key, and a lost session ends the
    wait (``GaveUp(Reason.SESSION_LOST)``). ``backoff`` gives every ``Pause``'s length.

    ``start()`` returns the first actions, ``feed(input)`` the next ones; ``outcome`` is
    None until the wait is over (``Held``, or ``GaveUp`` once our key is withdrawn). Late
    answers to requests in flight then are still fed: what they created (a lease granted,
    a key) is withdrawn again, so that nothing is left behind.
    """

    # Slots, no __dict__: one process may keep thousands waiting (docs/performance.md).
    __slots__ = (  # noqa: SIM905 (a list literal: 30 lines)
        "prefix max shared state outcome key lease_id revision value _backoff _ids _request"
        " _asked _watch _woke _pause _touch _touched _standing_at _ahead _watched _gap_asked"
        " _held_back _said _late _session_open _orphan _after_pause _gave_up _reentry"
    ).split()

    def __init__(
        self,
        prefix: bytes,
        max_holders: int,
        backoff: PauseSource,
        key: bytes | None = None,
        lease_id: int | None = None,
    ) -> None:
        if (key is None) != (lease_id is None):
            raise ValueError("key and lease_id go together (a shared session)")
        self.prefix = prefix
        self.max = max_holders
        self.shared = key is not None
        self.state = State.OPENING if key is None else State.ENQUEUEING
        self.outcome: m.Outcome | None = None
        self.key = key or b""
        self.lease_id = lease_id or 0
        self.revision = 0  # our key's create_revision; 0 while unknown
        self.value = b""
        self._backoff = backoff
        self._ids = itertools.count(1)  # every action's id, never reused
        self._request: int | None = None  # the one unary request on the main line
        self._asked: type[m.Request] | None = None  # its kind
        self._watch: int | None = None  # the watch we wait on
        self._woke: list[int] = []  # watches that woke us: cancelled after the next read
        self._pause: int | None = None
        self._touch: int | None = None  # a touch in flight, or its retry's pause
        self._touched = False  # our key re-put while waiting: the waiter behind has joined
        self._standing_at = 0  # the revision of the read our watch's keys come from
        self._ahead: list[KeyRev] = []  # in the window: every key ahead of ours
        self._watched: KeyRev | None = None  # behind (or spread-busy): the key we watch
        self._gap_asked: list[KeyRev] = []  # the keys of the gap check in flight
        self._held_back: list[m.Watched] = []  # window events awaiting the gap check
        self._said: set[str] = set()  # "queued" for our key; warnings of a run of failures
        self._late = False  # the deadline passed: give up before the next wait
        self._session_open = self.shared  # a private session to close when we give up
        self._orphan: int | None = None  # a request in flight when we gave up
        self._after_pause: Step = self._enqueue
        self._gave_up: m.GaveUp | None = None  # withdrawing to end so; None: to re-enter
        self._reentry = ""  # why we re-enter once withdrawn

    def start(self) -> list[m.Action]:
        """The first actions: open a session (private) or send the enqueue (shared)."""
        return self._enqueue() if self.shared else self._open_session()

    def queued_said_elsewhere(self) -> bool:
        """Whether ``queued`` was still to be said for our key: the driver says it now, its
        standing read parked behind a waiter of its own process (``conch.core.line``)."""
        return bool(self._once(m.Note("queued")))

    def feed(self, event: m.Input) -> list[m.Action]:
        """Advance on ``event``; return the actions to execute, in order."""
        if self.outcome is not None:
            return self._late_answer(event)
        if self.state == State.WITHDRAWING:
            return self._withdrawing(event)
        if isinstance(event, m.Interrupt):
            return self._give_up(*_interrupted(event))
        if isinstance(event, m.DeadlineReached):
            self._late = True  # enqueueing or reading: we try once, and give up before waiting
            if self.state in _WAITING or self.state == State.PAUSED:
                return self._give_up(Reason.NO_SLOT, "no free slot in time")
            return []
        if isinstance(event, m.SessionLost):
            return self._session_lost(event.reason)
        if isinstance(event, m.Failed) and event.id == self._watch:
            self._watch = None  # it could not be opened
            if event.failure == Failure.OTHER:
                return self._give_up(Reason.REFUSED, event.detail, event)
            return self._retry(event.detail)
        if isinstance(event, m.Watched):
            return self._on_watch(event)
        if isinstance(event, m.TouchAnswer | m.Failed | m.Over) and event.id == self._touch:
            return self._on_touch(event)
        if isinstance(event, m.Over):
            if event.id != self._pause or self.state != State.PAUSED:
                return []
            self._pause = None
            return self._after_pause()
        if not isinstance(event, m.Tagged) or event.id != self._request:
            return []  # a stale answer
        self._request = None
        if isinstance(event, m.Failed):
            return self._failed(event)
        self._said.difference_update(("etcd-away", "compacted"))  # etcd answered
        if isinstance(event, m.SessionOpened):
            self.key, self.lease_id = event.key, event.lease_id
            self._session_open = True
            return self._enqueue()
        if isinstance(event, m.EnqueueAnswer):
            return self._enqueued(event)
        if isinstance(event, m.StandingAnswer):
            return self._standing(event)
        if isinstance(event, m.KeysAnswer):
            return self._gap_checked(event)
        if isinstance(event, m.LeaseAnswer):
            if event.ttl <= 0:
                return self._give_up(Reason.SESSION_LOST, "session lost while queued: lease gone")
            return self._pause_then(self._enqueue, "our key is gone", requeue=True)
        return []

    # -- the main line -------------------------------------------------------------------

    def _send(self, action: m.Request) -> list[m.Action]:
        self._request, self._asked = action.id, type(action)
        return [action]

    def _open_session(self) -> list[m.Action]:
        self.state = State.OPENING
        return self._send(m.OpenSession(next(self._ids)))

    def _enqueue(self) -> list[m.Action]:
        self.state = State.ENQUEUEING
        self.revision = 0
        self._touched = False
        return self._send(m.SendEnqueue(next(self._ids), self.key, self.lease_id))

    def _read_standing(self) -> list[m.Action]:
        self.state = State.READING
        return self._send(m.ReadStanding(next(self._ids), self.key, self.revision))

    def _reread(self) -> Step:
        """How to look again once what we watch may have changed unseen."""
        return self._enqueue if self.state == State.SPREAD_BUSY else self._read_standing

    def _enqueued(self, answer: m.EnqueueAnswer) -> list[m.Action]:
        if answer.created:
            self.revision, self.value = answer.revision, answer.value
            self._said.discard("queued")  # a new key: say where it queues
            if answer.standing is None:
                return self._read_standing()
            return self._standing(answer.standing, fresh=True)
        found = answer.existing
        if found is None:
            return self._enqueue()  # deleted between compare and read: try again
        if answer.existing_ours:
            # An earlier attempt of ours went through; where we stood then is unknown.
            self.revision, self.value = found.create_revision, answer.value
            return self._read_standing()
        # --spread: our host's key, held by another process. Wait for it to change.
        self._standing_at, self._watched = answer.revision, found
        note = m.Note("spread-busy", {"rev": found.create_revision})
        return [note, *self._wait(State.SPREAD_BUSY, found.key)]

    def _standing(self, answer: m.StandingAnswer, fresh: bool = False) -> list[m.Action]:
        """Where our key stands; ``fresh``: read as it was put (it owes no touch)."""
        first = list(answer.window)
        mine = answer.mine_and_prev[0] if answer.mine_and_prev else None
        ahead = list(answer.mine_and_prev[1:])
        ours = mine is not None and mine.key == self.key and mine.create_revision == self.revision
        in_window = bool(first) and first[-1].key == self.key
        if ours and in_window and len(first) <= self.max:
            # The watch that woke us is retired by the hold, off the handoff's path.
            return self._held(answer.revision, self._woke, owes=not fresh)
        actions: list[m.Action] = [m.CancelWatch(w) for w in self._woke]
        self._woke = []
        if not ours:
            return actions + self._place_lost(_GONE)
        self._standing_at = answer.revision
        fields: dict[str, object] = {"rev": self.revision}
        if in_window:
            self._ahead = first[:-1]
            fields.update(position=len(first), ahead=len(self._ahead))
            state, key = State.IN_WINDOW, self.prefix
        elif not ahead:
            # Nobody ahead, yet not in the window: cannot be. Fail closed, re-enter.
            return actions + self._place_lost("inconsistent queue read; re-entering")
        else:
            self._watched = ahead[0]
            state, key = State.BEHIND, ahead[0].key
            if answer.keys is not None:
                fields.update(position=answer.keys, ahead=answer.keys - 1)
        return actions + self._once(m.Note("queued", fields)) + self._wait(state, key)

    def _wait(self, state: State, key: bytes) -> list[m.Action]:
        """Sleep on a watch of ``key`` from now (its confirmation then closes the gap since
        our read): in the window, the deletions under the prefix."""
        if self._late:
            return self._give_up(Reason.NO_SLOT, "no free slot in time")
        self.state = state
        self._watch = next(self._ids)
        self._held_back = []
        watch = m.OpenWatch(self._watch, key, prefix=state == State.IN_WINDOW)
        return [watch, *self._maybe_touch()]

    def _held(self, held_at: int, retire: list[int], owes: bool = True) -> list[m.Action]:
        """We hold at ``held_at``; ``owes``: the touch is the Hold's unless we made it."""
        touch = TouchOwed.AT_ONCE if self.max > 1 else TouchOwed.LATER
        if self._touched or not owes:
            touch = TouchOwed.NONE
        self._woke, self._watch = [], None  # every watch that woke us is among ``retire``
        self.state = State.HELD
        self.outcome = m.Held(
            self.key, self.lease_id, self.revision, held_at, self.value, touch, tuple(retire)
        )
        return []

    # -- the watch -----------------------------------------------------------------------

    def _on_watch(self, event: m.Watched) -> list[m.Action]:
        if event.id != self._watch or self.state not in _WAITING:
            return []
        if event.ended:
            self._watch = None
            return [m.Note("rewatch", {"reason": event.detail or "watch ended"}), *self._reread()()]
        if event.created:
            self._backoff.reset()  # etcd answers again: the next pause starts short
            if event.revision <= self._standing_at:
                return []  # nothing happened since our read
            ahead = [*self._ahead, KeyRev(self.key, self.revision, 0)]  # the window's, and ours
            self._gap_asked = (
                ahead if self.state == State.IN_WINDOW else [*filter(None, [self._watched])]
            )
            return self._send(m.ReadKeys(next(self._ids), [k.key for k in self._gap_asked]))
        if self.state == State.IN_WINDOW:
            if self._request is not None and self._asked is m.ReadKeys:
                # The gap check is unanswered: our own key may have been deleted between
                # our read and the watch's start, which this watch never shows. Count the
                # events once the check says nothing changed.
                self._held_back.append(event)
                return []
            return self._window_events(event)
        assert self._watched is not None
        if not any(e.key == self._watched.key for e in event.events):
            return []
        self._watch = None
        if self.state == State.SPREAD_BUSY:
            return [*self._enqueue(), m.CancelWatch(event.id)]
        self._woke.append(event.id)
        return self._read_standing()

    def _window_events(self, event: m.Watched) -> list[m.Action]:
        """Deletions under the prefix, in revision order: each one of a key ahead moves us
        up; the one that leaves fewer than N ahead means we hold at its revision. A deletion
        of our own key (in the same ordered stream) before that is a lost place."""
        deletions = [e for e in event.events if e.deleted]
        if any(kv.key == self.key for kv in deletions):
            return self._place_lost("our key was deleted while queued")
        for deleted in deletions:
            before = len(self._ahead)
            self._ahead = [k for k in self._ahead if k.key != deleted.key]
            if len(self._ahead) < before and len(self._ahead) < self.max:
                return self._held(deleted.mod_revision, [event.id])
        self._standing_at = max(self._standing_at, event.revision)
        return self._maybe_touch()

    def _gap_checked(self, answer: m.KeysAnswer) -> list[m.Action]:
        """Whether a watched key changed between our read and the watch's start. In the
        window a key ahead gone (absent, or created again) counts as a deletion, after the
        events held back while it was unanswered (one may be the release we hold on): keys
        ahead only ever leave, so the queue is not read again. Our own key gone, or behind
        any change of the key ahead, means reading again."""
        held_back, self._held_back = self._held_back, []
        if self.state not in _WAITING:
            return []
        window = self.state == State.IN_WINDOW
        gone = [
            then
            for then, now in zip(self._gap_asked, answer.kvs, strict=True)
            if now is None
            or now.create_revision != then.create_revision
            or (not window and now.mod_revision != then.mod_revision)
        ]
        if gone and (not window or any(k.key == self.key for k in gone)):
            stale, self._watch = self._watch, None
            return [*self._reread()(), *([m.CancelWatch(stale)] if stale is not None else [])]
        actions: list[m.Action] = []
        for event in held_back:
            if event.id != self._watch or self.state != State.IN_WINDOW:
                break
            actions += self._window_events(event)
        if self.state != State.IN_WINDOW:
            return actions  # behind, nothing changed; or held on an event held back
        # Ours was there at the check, and at each event counted (they come in order).
        seen = max([answer.revision, *(e.mod_revision for h in held_back for e in h.events)])
        deletions = [KeyRev(k.key, k.create_revision, seen, True) for k in gone]
        return actions + self._window_events(m.Watched(self._watch or 0, deletions, seen))

    # -- the touch -----------------------------------------------------------------------

    def _maybe_touch(self) -> list[m.Action]:
        # With fewer keys than this ahead of ours, the waiter behind us (if any) belongs in
        # the window: we owe it a touch.
        owed = self.state == State.IN_WINDOW and not self._touched and self._touch is None
        if not owed or len(self._ahead) >= window_size(self.max) - 1:
            return []
        self._touch = next(self._ids)
        return [m.Touch(self._touch, self.key, self.revision, self.value, self.lease_id)]

    def _on_touch(self, answer: m.TouchAnswer | m.Failed | m.Over) -> list[m.Action]:
        self._touch = None
        if isinstance(answer, m.Over):  # the pause before its retry ran its length
            return self._maybe_touch()
        if isinstance(answer, m.TouchAnswer):
            self._said.discard("touch-failed")
            self._touched = answer.succeeded
            return [] if answer.succeeded else self._place_lost(_GONE)
        if answer.failure in (Failure.UNREACHABLE, Failure.NO_SPACE, Failure.COMPACTED):
            # Keep our place; the waiter behind still wakes when our key goes. The alarm
            # may last hours: said once per run of failures.
            self._touch = next(self._ids)  # the retry's pause: its Over touches again
            note = m.Note("touch-failed", {"error": answer.detail}, warning=True)
            return [*self._once(note), m.Pause(self._touch, self._backoff.next())]
        if answer.failure == Failure.LEASE_NOT_FOUND:
            return self._place_lost("our lease is gone")
        return self._give_up(Reason.REFUSED, answer.detail, answer)

    # -- failures, pauses, loss ----------------------------------------------------------

    def _failed(self, failure: m.Failed) -> list[m.Action]:
        asked = self._asked
        if failure.failure == Failure.OTHER:
            return self._give_up(Reason.REFUSED, failure.detail, failure)
        if asked is m.OpenSession:
            if not self.lease_id:  # no session was ever ours
                return self._give_up(Reason.UNAVAILABLE, failure.detail, failure)
            return self._pause_then(self._open_session, failure.detail, requeue=True)
        if failure.failure == Failure.LEASE_NOT_FOUND:
            # The lease expired (a process stopped between its grant and our write, or the
            # lease was revoked from outside): the session is lost.
            return self._session_lost("lease expired or was revoked")
        # etcd away for a moment, or refusing writes: our key (if it was written) and the
        # lease may well be alive. Keep them; ask again after a pause.
        if asked is m.SendEnqueue:
            return self._pause_then(self._enqueue, failure.detail)
        if asked is m.CheckLease:
            # The keepalive decides whether the session lives: re-enter on it meanwhile.
            return self._pause_then(self._enqueue, failure.detail, requeue=True)
        if failure.failure == Failure.COMPACTED and "compacted" not in self._said:
            # A read pinned to a revision compaction just passed: etcd is there. Read again
            # at once, from the present (etcd-away's pause only if it happens twice running).
            self._said.add("compacted")
            return [*self._cancel_watches(), *self._reread()()]
        return self._retry(failure.detail)  # a standing read or a gap check

    def _retry(self, cause: str) -> list[m.Action]:
        return [*self._cancel_watches(), *self._pause_then(self._reread(), cause)]

    def _pause_then(self, after: Step, cause: str, requeue: bool = False) -> list[m.Action]:
        if self._late:
            return self._give_up(Reason.NO_SLOT, f"no free slot in time: {cause}")
        self.state = State.PAUSED
        self._after_pause = after
        self._pause = next(self._ids)
        pause = m.Pause(self._pause, self._backoff.next())
        if requeue:
            self._said.discard("etcd-away")
            return [m.Note("requeue", {"reason": cause}, warning=True), pause]
        return [*self._once(m.Note("etcd-away", {"reason": cause}, warning=True)), pause]

    def _once(self, note: m.Note) -> list[m.Action]:
        """``note``, unless said already (in this run of failures, or for this key)."""
        said = note.event in self._said
        self._said.add(note.event)
        return [] if said else [note]

    def _place_lost(self, reason: str) -> list[m.Action]:
        """Our key is gone while we wait: re-enter at the back of the queue (a private
        session: revoke it first, best effort, then pause and re-enter with a new one). On a
        shared session only if its lease lives (a key deleted by hand): ask etcd first."""
        actions = self._cancel_watches()
        if not self.shared:
            self._gave_up, self._reentry = None, reason
            return [*actions, *self._withdraw()]
        self.state = State.READING
        self.revision = 0
        check = self._send(m.CheckLease(next(self._ids), self.lease_id))
        return [*actions, m.Note("lease-check", {"reason": reason}), *check]

    def _session_lost(self, reason: str) -> list[m.Action]:
        if not self._session_open:
            return []  # not the session we are on (none yet, or a closed one)
        if self.shared:
            return self._give_up(Reason.SESSION_LOST, f"session lost while queued: {reason}")
        return self._place_lost(f"session lost: {reason}")

    # -- giving up -----------------------------------------------------------------------

    def _cancel_watches(self) -> list[m.Action]:
        ids = [*self._woke, *([self._watch] if self._watch is not None else [])]
        self._woke, self._watch, self._held_back, self._touch = [], None, [], None
        return [m.CancelWatch(w) for w in ids]

    def _give_up(self, reason: Reason, detail: str, cause: object = None) -> list[m.Action]:
        actions = self._cancel_watches()
        self._gave_up = m.GaveUp(reason, detail, cause)
        self._orphan, self._request = self._request, None
        if not self._session_open:
            self.state, self.outcome = State.DONE, self._gave_up
            return actions
        return [*actions, *self._withdraw()]

    def _withdraw(self) -> list[m.Action]:
        self.state = State.WITHDRAWING
        revoke = not self.shared
        self._session_open = not revoke  # a private session is closed by the revoke
        withdraw = m.Withdraw(next(self._ids), self.key, self.revision, self.lease_id, revoke)
        return self._send(withdraw)

    def _withdrawing(self, event: m.Input) -> list[m.Action]:
        if isinstance(event, m.Interrupt) and self._gave_up is None:
            self._gave_up = m.GaveUp(*_interrupted(event))  # to re-enter: stop there instead
        elif isinstance(event, m.DeadlineReached):
            self._late = True
        elif isinstance(event, m.Over) and event.id == self._request:  # our key is out
            self._request = None
            if self._gave_up is None:  # a private session's: re-enter with a new one
                return self._pause_then(self._open_session, self._reentry, requeue=True)
            self.state, self.outcome = State.DONE, self._gave_up
            return []
        return self._late_answer(event)

    def _late_answer(self, event: m.Input) -> list[m.Action]:
        if self._orphan is None or getattr(event, "id", None) != self._orphan:
            return []
        self._orphan = None
        if isinstance(event, m.SessionOpened):
            return [m.Withdraw(next(self._ids), event.key, 0, event.lease_id, revoke=True)]
        if isinstance(event, m.EnqueueAnswer) and event.created and self.shared:
            return [m.Withdraw(next(self._ids), self.key, event.revision, self.lease_id, False)]
        return []


def _interrupted(event: m.Interrupt) -> tuple[Reason, str, object]:
    return Reason.INTERRUPTED, f"interrupted: {event.reason}", event.reason
