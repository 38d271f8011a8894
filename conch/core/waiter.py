"""The waiting recipe as a pure state machine: inputs in, actions out, no I/O.

As h11 does for HTTP, this module decides and never does: no sockets, no threads, no
clock, no gRPC. A ``Waiter`` is one acquire of one semaphore (docs/design.md, "Waiting",
draws it): it says which etcd request to send (``SendEnqueue``, ``ReadStanding``,
``OpenWatch``, ``Touch``, ...) and is told what came back (``EnqueueAnswer``,
``StandingAnswer``, ``WatchEvents``, ``Failed``, ...). Every request carries an ``id``; the
driver feeds back the answer with that id (a stale id, from a request the machine has moved
past, is ignored). Time reaches it only as inputs (``DeadlineReached``, ``PauseOver``);
``Pause`` says how long, from the ``Backoff`` the driver gave it.

A driver is a short loop (``conch/semaphore.py`` is the threaded one)::

    waiter = Waiter(prefix, max_holders, backoff=Backoff(), key=..., lease_id=...)
    todo = deque(waiter.start())
    while waiter.outcome is None:
        if todo:
            answer = execute(todo.popleft())    # a unary call answers at once, or None
        else:
            answer = next_input()               # a watch notice, a loss, a deadline, ...
        if answer is not None:
            todo.extend(waiter.feed(answer))
    # waiter.outcome: Held (the slot, at a revision), or a GaveUp with its Reason

Actions are executed in the order given: the machine puts the one on the handoff's path
first (a read before the cancel of the watch that woke it). ``Note`` actions are log lines
(``event``, ``fields``) and need no answer.

What the machine keeps from the recipe (conch/semaphore.py's docstring has the reasoning):
the window of ``window_size(N)`` keys watching the deletions under the prefix; behind it, the
watch on the immediate predecessor; the touch that pulls the next waiter into the window;
``--spread``'s busy host; the private session (re-entered at the back of the queue with a
new lease when lost) and the shared one (our key withdrawn by deleting it, SessionLost
raised instead of re-entering). What it adds: etcd unreachable for a moment (a request
``Failed`` with ``Failure.UNREACHABLE``) keeps our key and reads the standing again once
etcd answers, for as long as the session is not lost; etcd refusing writes
(``Failure.NO_SPACE``, its space alarm) keeps our place too, the touch retried after a pause.

Once a slot is held, the Hold's guard decides (``conch.core.guard``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

from conch.core.messages import (
    Action,
    CancelWatch,
    CheckLease,
    DeadlineReached,
    EnqueueAnswer,
    EventType,
    Failed,
    Failure,
    GaveUp,
    Held,
    Input,
    Interrupt,
    KeyRev,
    KeysAnswer,
    LeaseAnswer,
    Note,
    OpenSession,
    OpenWatch,
    Outcome,
    Pause,
    PauseOver,
    ReadKeys,
    ReadStanding,
    Reason,
    SendEnqueue,
    SessionLost,
    SessionOpened,
    StandingAnswer,
    Touch,
    TouchAnswer,
    TouchOwed,
    WatchBroken,
    WatchCreated,
    WatchEvents,
    Withdraw,
    Withdrawn,
)

# Waiters in the window beyond the N holders, at most: each release wakes them all (one
# watch event each), so their number stays small whatever the max.
WINDOW_WAITERS_CAP = 8


def window_size(max_holders: int) -> int:
    """How many keys, from the first by create_revision, the window holds: the holders and
    up to N + 1 waiters (capped), so that N releases in a row still find a waiter in the
    window for each slot before the one behind has joined it."""
    return max_holders + min(max_holders + 1, WINDOW_WAITERS_CAP)


class PauseSource(Protocol):
    """Where a ``Pause``'s length comes from: ``conch.etcd.client.Backoff`` (capped,
    jittered; seconds)."""

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


# -- the waiter ----------------------------------------------------------------------------

_WAITING = (State.IN_WINDOW, State.BEHIND, State.SPREAD_BUSY)
_FINAL = (State.HELD, State.DONE)


class Waiter:
    """One acquire of the semaphore whose keys live under ``prefix`` (``max_holders`` slots).

    Without ``key`` and ``lease_id``, the waiter runs on a private session: it asks for one
    (``OpenSession``), withdraws by revoking it, and when its place is lost (our key gone,
    the session lost) it re-enters at the back of the queue with a new one. With them, it
    runs on the caller's shared session: it withdraws by deleting its key, and a lost
    session ends the wait (``GaveUp(Reason.SESSION_LOST)``). ``backoff`` gives every
    ``Pause``'s length (capped, jittered).

    ``start()`` returns the first actions, ``feed(input)`` the next ones; ``outcome`` is
    None until the wait is over (``Held``, or ``GaveUp`` once our key is withdrawn). After
    that, late answers to requests still in flight are handled so that nothing is left
    behind (a lease granted or a key created after we gave up is withdrawn again).
    """

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
        self.outcome: Outcome | None = None
        self.key = key or b""
        self.lease_id = lease_id or 0
        self.revision = 0  # our key's create_revision; 0 while unknown
        self.value = b""
        self._backoff = backoff
        self._ids = 0
        self._request: int | None = None  # the one unary request on the main line
        self._watch: int | None = None  # the watch we wait on
        self._woke: list[int] = []  # watches that woke us: cancelled after the next read
        self._pause: int | None = None
        self._touch: int | None = None  # a touch in flight, or its retry's pause
        self._touch_paused = False
        self._touched = False  # our key re-put while waiting: the waiter behind has joined
        self._standing_at = 0  # the revision of the read our watch's keys come from
        self._ahead: list[KeyRev] = []  # in the window: every key ahead of ours
        self._watched: KeyRev | None = None  # behind (or spread-busy): the key we watch
        self._gap_asked: list[KeyRev] = []  # the keys of the gap check in flight
        self._held_back: list[WatchEvents] = []  # window events awaiting the gap check
        self._away = False  # "etcd-away" said for the failures in a row now
        self._touch_failing = False  # "touch-failed" said likewise
        self._late = False  # the deadline passed: give up before the next wait
        self._entered = self.shared  # a session was ever ours
        self._session_open = self.shared  # a private session to close when we give up
        self._queued_noted = False
        self._asked: type[Action] | None = None  # the kind of ``_request``
        self._orphan: int | None = None  # a request in flight when we gave up
        self._after_pause: Callable[[], list[Action]] = self._enqueue
        self._after_withdraw: Callable[[], list[Action]] = self._finish
        self._pending_outcome: GaveUp | None = None

    # -- the public surface --------------------------------------------------------------

    def start(self) -> list[Action]:
        """The first actions: open a session (private) or send the enqueue (shared)."""
        return self._open_session() if not self.shared else self._enqueue()

    @property
    def touch_below(self) -> int:
        """With fewer keys than this ahead of ours, the waiter just behind us (if any)
        belongs in the window: we owe it a touch."""
        return window_size(self.max) - 1

    def feed(self, event: Input) -> list[Action]:
        """Advance on ``event``; return the actions to execute, in order."""
        if self.state in _FINAL:
            return self._after_end(event)
        if self.state == State.WITHDRAWING:
            return self._withdrawing(event)
        if isinstance(event, Interrupt):
            return self._give_up(Reason.INTERRUPTED, f"interrupted: {event.reason}", event.reason)
        if isinstance(event, DeadlineReached):
            return self._deadline()
        if isinstance(event, SessionLost):
            return self._session_lost(event.reason)
        if isinstance(event, Failed) and event.id == self._watch:
            return self._watch_failed(event)
        if isinstance(event, (WatchCreated, WatchEvents, WatchBroken)):
            return self._on_watch(event)
        if isinstance(event, PauseOver):
            return self._pause_over(event)
        if isinstance(event, (TouchAnswer, Failed)) and event.id == self._touch:
            return self._on_touch(event)
        if getattr(event, "id", None) != self._request:
            return []  # a stale answer
        self._request = None
        if isinstance(event, Failed):
            return self._failed(event)
        self._away = False  # etcd answered
        if isinstance(event, SessionOpened):
            return self._opened(event)
        if isinstance(event, EnqueueAnswer):
            return self._enqueued(event)
        if isinstance(event, StandingAnswer):
            return self._standing(event)
        if isinstance(event, KeysAnswer):
            return self._gap_checked(event)
        if isinstance(event, LeaseAnswer):
            return self._lease_checked(event)
        return []

    # -- requests ------------------------------------------------------------------------

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def _send(self, action: Action) -> list[Action]:
        """``action`` as the one request on the main line (its id is ``_request``)."""
        self._request = getattr(action, "id", None)
        self._asked = type(action)
        return [action]

    def _open_session(self) -> list[Action]:
        self.state = State.OPENING
        return self._send(OpenSession(self._new_id()))

    def _opened(self, answer: SessionOpened) -> list[Action]:
        self.key, self.lease_id = answer.key, answer.lease_id
        self._entered = self._session_open = True
        return self._enqueue()

    def _enqueue(self) -> list[Action]:
        self.state = State.ENQUEUEING
        self.revision = 0
        self._touched = False
        return self._send(SendEnqueue(self._new_id(), self.key, self.lease_id))

    def _read_standing(self) -> list[Action]:
        self.state = State.READING
        return self._send(ReadStanding(self._new_id(), self.key, self.revision))

    # -- enqueueing ----------------------------------------------------------------------

    def _enqueued(self, answer: EnqueueAnswer) -> list[Action]:
        if answer.created:
            self.revision, self.value = answer.revision, answer.value
            self._queued_noted = False  # a new key: say where it queues
            if self.key in answer.heads:
                return self._held(answer.revision, TouchOwed.NONE, ())
            return self._read_standing()
        found = answer.existing
        if found is None:
            return self._enqueue()  # deleted between compare and read: try again
        if answer.existing_ours:
            # An earlier attempt of ours went through; where we stood then is unknown.
            self.revision, self.value = found.create_revision, answer.value
            return self._read_standing()
        # --spread: our host's key, held by another process. Wait for it to change.
        note = Note("spread-busy", {"rev": found.create_revision})
        self._standing_at, self._watched = answer.revision, found
        return [note, *self._wait(State.SPREAD_BUSY)]

    # -- the standing --------------------------------------------------------------------

    def _standing(self, answer: StandingAnswer) -> list[Action]:
        first = list(answer.window)
        mine: KeyRev | None = answer.mine_and_prev[0] if answer.mine_and_prev else None
        ahead = list(answer.mine_and_prev[1:])
        ours = mine is not None and mine.key == self.key and mine.create_revision == self.revision
        if ours and first and first[-1].key == self.key and len(first) <= self.max:
            # The watch that woke us is retired by the hold, off the handoff's path.
            return self._held(answer.revision, self._owed(), tuple(self._woke))
        actions: list[Action] = [CancelWatch(w) for w in self._woke]
        self._woke = []
        if not ours:
            return actions + self._place_lost("our key is gone (lease expired or key deleted)")
        self._standing_at = answer.revision
        if first and first[-1].key == self.key:
            self._ahead = first[:-1]
            state = State.IN_WINDOW
        elif not ahead:
            # Nobody ahead, yet not in the window: cannot be. Fail closed, re-enter.
            return actions + self._place_lost("inconsistent queue read; re-entering")
        else:
            self._watched = ahead[0]
            state = State.BEHIND
        if not self._queued_noted:
            self._queued_noted = True
            fields: dict[str, object] = {"rev": self.revision}
            if state == State.IN_WINDOW:
                fields.update(position=len(self._ahead) + 1, ahead=len(self._ahead))
            actions.append(Note("queued", fields))
        return actions + self._wait(state)

    def _wait(self, state: State) -> list[Action]:
        """Sleep on a watch from now (WatchCreated then closes the gap since our read)."""
        if self._late:
            return self._give_up(Reason.NO_SLOT, "no free slot in time")
        self.state = state
        self._watch = self._new_id()
        self._held_back = []
        window = state == State.IN_WINDOW
        assert window or self._watched is not None
        key = self.prefix if window else self._watched.key  # type: ignore[union-attr]
        return [OpenWatch(self._watch, key, prefix=window), *self._maybe_touch()]

    def _owed(self) -> TouchOwed:
        if self._touched:
            return TouchOwed.NONE
        return TouchOwed.AT_ONCE if self.max > 1 else TouchOwed.LATER

    def _held(self, held_at: int, touch: TouchOwed, retire: Sequence[int]) -> list[Action]:
        actions: list[Action] = [CancelWatch(w) for w in self._woke if w not in retire]
        self._woke, self._watch = [], None
        self.state = State.HELD
        self.outcome = Held(
            self.key, self.lease_id, self.revision, held_at, self.value, touch, tuple(retire)
        )
        return actions

    # -- the watch -----------------------------------------------------------------------

    def _on_watch(self, event: WatchCreated | WatchEvents | WatchBroken) -> list[Action]:
        if event.id != self._watch or self.state not in _WAITING:
            return []
        if isinstance(event, WatchBroken):
            self._watch = None
            note = Note("rewatch", {"reason": event.detail or "watch ended"})
            if self.state == State.SPREAD_BUSY:
                return [note, *self._enqueue()]
            return [note, *self._read_standing()]
        if isinstance(event, WatchCreated):
            self._backoff.reset()  # etcd answers again: the next pause starts short
            if event.revision <= self._standing_at:
                return []  # nothing happened since our read
            self._gap_asked = self._watched_keys()
            return self._send(ReadKeys(self._new_id(), [k.key for k in self._gap_asked]))
        if self.state == State.IN_WINDOW:
            if self._request is not None and self._asked is ReadKeys:
                # The gap check is unanswered: our own key may have been deleted between
                # our read and the watch's start, which this watch never shows. Count the
                # events once the check says nothing changed.
                self._held_back.append(event)
                return []
            return self._window_events(event)
        assert self._watched is not None
        if not any(e.kv.key == self._watched.key for e in event.events):
            return []
        self._woke.append(event.id)
        self._watch = None
        if self.state == State.SPREAD_BUSY:
            self._woke = []
            return [*self._enqueue(), CancelWatch(event.id)]
        return self._read_standing()

    def _watched_keys(self) -> list[KeyRev]:
        if self.state == State.IN_WINDOW:
            return [*self._ahead, KeyRev(self.key, self.revision, 0)]
        assert self._watched is not None
        return [self._watched]

    def _window_events(self, event: WatchEvents) -> list[Action]:
        """Deletions under the prefix, in revision order: each one of a key ahead moves us
        up; the one that leaves fewer than N ahead means we hold at its revision. A deletion
        of our own key (in the same ordered stream) before that is a lost place."""
        deletions = [e.kv for e in event.events if e.type == EventType.DELETE]
        if any(kv.key == self.key for kv in deletions):
            return self._place_lost("our key was deleted while queued")
        for deleted in deletions:
            before = len(self._ahead)
            self._ahead = [k for k in self._ahead if k.key != deleted.key]
            if len(self._ahead) < before and len(self._ahead) < self.max:
                return self._held(deleted.mod_revision, self._owed(), (event.id,))
        self._standing_at = max(self._standing_at, event.revision)
        return self._maybe_touch()

    def _gap_checked(self, answer: KeysAnswer) -> list[Action]:
        """Whether a watched key changed between our read and the watch's start: in the
        window a deletion (create_revision differs or absent); behind, any change. In the
        window, the events held back while it was unanswered are counted once it says
        nothing changed (one of them may be the release we hold on)."""
        held_back, self._held_back = self._held_back, []
        if self.state not in _WAITING:
            return []
        any_put = self.state != State.IN_WINDOW
        # Only the keys still watched. A key ahead whose deletion is among the events held
        # back is gone whenever it went (the check reads at or after the watch's start):
        # that event counts it below. Our own key absent is always a change.
        still = {k.key for k in self._watched_keys()}
        still -= {
            e.kv.key
            for held in held_back
            for e in held.events
            if e.type == EventType.DELETE and e.kv.key != self.key
        }
        if not any(
            then.key in still
            and (
                now is None
                or now.create_revision != then.create_revision
                or (any_put and now.mod_revision != then.mod_revision)
            )
            for then, now in zip(self._gap_asked, answer.kvs, strict=True)
        ):
            actions: list[Action] = []
            for event in held_back:
                if event.id != self._watch or self.state != State.IN_WINDOW:
                    break
                actions += self._window_events(event)
            return actions
        stale, self._watch = self._watch, None
        after = self._enqueue() if self.state == State.SPREAD_BUSY else self._read_standing()
        return [*after, *([CancelWatch(stale)] if stale is not None else [])]

    # -- the touch -----------------------------------------------------------------------

    def _maybe_touch(self) -> list[Action]:
        if (
            self.state != State.IN_WINDOW
            or self._touched
            or self._touch is not None
            or len(self._ahead) >= self.touch_below
        ):
            return []
        self._touch = self._new_id()
        return [Touch(self._touch, self.key, self.revision, self.value, self.lease_id)]

    def _on_touch(self, answer: TouchAnswer | Failed) -> list[Action]:
        self._touch = None
        if isinstance(answer, TouchAnswer):
            self._touch_failing = False
            if answer.succeeded:
                self._touched = True
                return []
            return self._place_lost("our key is gone (lease expired or key deleted)")
        if answer.failure in (Failure.UNREACHABLE, Failure.NO_SPACE):
            # Keep our place; the waiter behind still wakes when our key goes.
            self._touch = self._new_id()
            self._touch_paused = True
            pause: list[Action] = [Pause(self._touch, self._backoff.next())]
            if self._touch_failing:
                return pause  # said once per run of failures: the alarm may last hours
            self._touch_failing = True
            return [Note("touch-failed", {"error": answer.detail}, warning=True), *pause]
        if answer.failure == Failure.LEASE_NOT_FOUND:
            return self._place_lost("our lease is gone")
        return self._give_up(Reason.REFUSED, answer.detail, answer)

    # -- failures, pauses, loss ----------------------------------------------------------

    def _failed(self, failure: Failed) -> list[Action]:
        asked = self._asked
        if failure.failure == Failure.OTHER:
            return self._give_up(Reason.REFUSED, failure.detail, failure)
        if asked is OpenSession:
            if not self._entered:
                return self._give_up(Reason.UNAVAILABLE, failure.detail, failure)
            return self._pause_then(self._open_session, failure.detail, requeue=True)
        if failure.failure == Failure.LEASE_NOT_FOUND:
            # The lease expired (a process stopped between its grant and our write, or the
            # lease was revoked from outside): the session is lost.
            return self._session_lost("lease expired or was revoked")
        # etcd away for a moment, or refusing writes: our key (if it was written) and the
        # lease may well be alive. Keep them; ask again after a pause.
        if asked is SendEnqueue:
            return self._pause_then(self._enqueue, failure.detail)
        if asked is CheckLease:
            # The keepalive decides whether the session lives: re-enter on it meanwhile.
            return self._pause_then(self._enqueue, failure.detail, requeue=True)
        if self.state == State.SPREAD_BUSY:
            return [*self._cancel_watches(), *self._pause_then(self._enqueue, failure.detail)]
        # A standing read or a gap check: read again.
        actions = self._cancel_watches()
        return [*actions, *self._pause_then(self._read_standing, failure.detail)]

    def _watch_failed(self, failure: Failed) -> list[Action]:
        """The watch could not be opened (the client's stream cannot be opened)."""
        self._watch = None
        if failure.failure == Failure.OTHER:
            return self._give_up(Reason.REFUSED, failure.detail, failure)
        after = self._enqueue if self.state == State.SPREAD_BUSY else self._read_standing
        return [*self._cancel_watches(), *self._pause_then(after, failure.detail)]

    def _pause_then(
        self, after: Callable[[], list[Action]], cause: str, requeue: bool = False
    ) -> list[Action]:
        if self._late:
            return self._give_up(Reason.NO_SLOT, f"no free slot in time: {cause}")
        self.state = State.PAUSED
        self._after_pause = after
        self._pause = self._new_id()
        pause: list[Action] = [Pause(self._pause, self._backoff.next())]
        if not requeue and self._away:
            return pause  # said once per run of failures
        self._away = not requeue
        note = Note("requeue" if requeue else "etcd-away", {"reason": cause}, warning=True)
        return [note, *pause]

    def _pause_over(self, event: PauseOver) -> list[Action]:
        if event.id == self._touch and self._touch_paused:
            self._touch, self._touch_paused = None, False
            return self._maybe_touch()
        if event.id != self._pause or self.state != State.PAUSED:
            return []
        self._pause = None
        return self._after_pause()

    def _place_lost(self, reason: str) -> list[Action]:
        """Our key is gone while we wait: re-enter at the back of the queue. On a shared
        session only if its lease lives (a key deleted by hand): ask etcd first."""
        actions = self._cancel_watches()
        if self.shared:
            self.state = State.READING
            self.revision = 0
            check = self._send(CheckLease(self._new_id(), self.lease_id))
            return [*actions, Note("lease-check", {"reason": reason}), *check]
        return [*actions, *self._close_then_reenter(reason)]

    def _lease_checked(self, answer: LeaseAnswer) -> list[Action]:
        if answer.ttl <= 0:
            return self._give_up(Reason.SESSION_LOST, "session lost while queued: lease gone")
        return self._pause_then(self._enqueue, "our key is gone", requeue=True)

    def _close_then_reenter(self, reason: str) -> list[Action]:
        """Private session: revoke it (best effort), then pause and re-enter with a new one."""
        self._pending_outcome = None
        self._after_withdraw = lambda: self._pause_then(self._open_session, reason, requeue=True)
        return self._withdraw()

    def _session_lost(self, reason: str) -> list[Action]:
        if not self._session_open:
            return []  # not the session we are on (none yet, or a closed one)
        actions = self._cancel_watches()
        if self.shared:
            return [
                *actions,
                *self._give_up(Reason.SESSION_LOST, f"session lost while queued: {reason}"),
            ]
        return [*actions, *self._close_then_reenter(f"session lost: {reason}")]

    def _deadline(self) -> list[Action]:
        self._late = True
        if self.state in _WAITING or self.state == State.PAUSED:
            return self._give_up(Reason.NO_SLOT, "no free slot in time")
        return []  # enqueueing or reading: we try once, and give up before waiting

    # -- giving up -----------------------------------------------------------------------

    def _cancel_watches(self) -> list[Action]:
        ids = [*self._woke, *([self._watch] if self._watch is not None else [])]
        self._woke, self._watch, self._held_back = [], None, []
        self._touch, self._touch_paused = None, False
        return [CancelWatch(w) for w in ids]

    def _give_up(self, reason: Reason, detail: str, cause: object = None) -> list[Action]:
        actions = self._cancel_watches()
        outcome = GaveUp(reason, detail, cause)
        self._orphan, self._request = self._request, None
        if not self._session_open:
            self.state, self.outcome = State.DONE, outcome
            return actions
        self._pending_outcome = outcome
        self._after_withdraw = self._finish
        return [*actions, *self._withdraw()]

    def _withdraw(self) -> list[Action]:
        self.state = State.WITHDRAWING
        revoke = not self.shared
        if revoke:
            self._session_open = False
        withdraw = Withdraw(self._new_id(), self.key, self.revision, self.lease_id, revoke)
        return self._send(withdraw)

    def _withdrawing(self, event: Input) -> list[Action]:
        if isinstance(event, Interrupt) and self._pending_outcome is None:
            # Withdrawing to re-enter: stop there instead.
            self._pending_outcome = GaveUp(
                Reason.INTERRUPTED, f"interrupted: {event.reason}", event.reason
            )
            self._after_withdraw = self._finish
        elif isinstance(event, DeadlineReached):
            self._late = True
        elif isinstance(event, Withdrawn) and event.id == self._request:
            self._request = None
            return self._after_withdraw()
        return self._late_answer(event)

    def _finish(self) -> list[Action]:
        assert self._pending_outcome is not None
        self.state, self.outcome = State.DONE, self._pending_outcome
        return []

    def _after_end(self, event: Input) -> list[Action]:
        """Once the wait is over: late answers to requests in flight when we gave up."""
        return self._late_answer(event) if self.state == State.DONE else []

    def _late_answer(self, event: Input) -> list[Action]:
        """What a request in flight when we gave up created is withdrawn again."""
        if self._orphan is None or getattr(event, "id", None) != self._orphan:
            return []
        self._orphan = None
        if isinstance(event, SessionOpened):
            return [Withdraw(self._new_id(), event.key, 0, event.lease_id, revoke=True)]
        if isinstance(event, EnqueueAnswer) and event.created and self.shared:
            return [Withdraw(self._new_id(), self.key, event.revision, self.lease_id, False)]
        return []
