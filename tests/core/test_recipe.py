"""The waiting recipe's state machine (conch/core/waiter.py), fed by hand: no etcd, no threads,
no clock. Each test plays one path of docs/design.md's drawing and asserts the actions the
machine asks for, in order. The same behaviours are tested against a real etcd in
test_sema.py, test_library.py, test_sessions.py, test_failures.py and test_waiting.py."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

import pytest

from conch.core import guard as g
from conch.core import messages as m
from conch.core import waiter as r
from conch.core.loss import Loss
from conch.etcd.client import Backoff

PREFIX = b"/p/"
ME = b"/p/me"
LEASE = 0x5


class FixedPauses:
    """Pauses of 1 s; counts resets."""

    def __init__(self) -> None:
        self.resets = 0

    def next(self) -> float:
        return 1.0

    def reset(self) -> None:
        self.resets += 1


def kr(name: str, create: int, mod: int | None = None) -> m.KeyRev:
    return m.KeyRev(PREFIX + name.encode(), create, create if mod is None else mod)


def mine(create: int) -> m.KeyRev:
    return m.KeyRev(ME, create, create)


def deleted(key: m.KeyRev, at: int) -> m.KeyRev:
    return m.KeyRev(key.key, key.create_revision, at, deleted=True)


A = TypeVar("A")


def only(actions: Sequence[m.Action], kind: type[A]) -> A:
    (found,) = [a for a in actions if isinstance(a, kind)]
    return found


def state_of(waiter: r.Waiter) -> r.State:
    return waiter.state


def kinds(actions: Sequence[m.Action]) -> list[type[m.Action]]:
    return [type(a) for a in actions if not isinstance(a, m.Note)]


def private(max_holders: int = 1) -> tuple[r.Waiter, m.SendEnqueue]:
    """A waiter on a private session, its session opened: it asks to enqueue."""
    waiter = r.Waiter(PREFIX, max_holders, FixedPauses())
    (opening,) = waiter.start()
    assert isinstance(opening, m.OpenSession)
    (enqueue,) = waiter.feed(m.SessionOpened(opening.id, LEASE, ME))
    assert isinstance(enqueue, m.SendEnqueue) and enqueue.key == ME
    return waiter, enqueue


def queued(
    waiter: r.Waiter, enqueue: m.SendEnqueue, ahead: Sequence[m.KeyRev], at: int = 10
) -> list[m.Action]:
    """Our key created at ``at`` behind ``ahead`` (all in the window, or the window full):
    the actions after the standing read."""
    (read,) = waiter.feed(m.EnqueueAnswer(enqueue.id, at, True, b"v"))
    assert isinstance(read, m.ReadStanding) and read.revision == at
    window_keys = r.window_size(waiter.max)
    window = [*ahead, mine(at)][:window_keys]
    return waiter.feed(m.StandingAnswer(read.id, at, window, [mine(at), ahead[-1]]))


def test_a_waiter_whose_key_is_among_the_first_n_at_its_creation_holds_and_owes_no_touch() -> None:
    waiter, enqueue = private(2)
    standing = m.StandingAnswer(enqueue.id, 7, [kr("a", 3), mine(7)], [mine(7), kr("a", 3)], 2)
    actions = waiter.feed(m.EnqueueAnswer(enqueue.id, 7, True, b"v", standing=standing))
    assert actions == []
    assert waiter.outcome == m.Held(ME, LEASE, 7, 7, b"v", m.TouchOwed.NONE, ())
    assert waiter.state == r.State.HELD


def test_the_standing_read_in_the_enqueue_places_a_new_key_without_reading_again() -> None:
    waiter, enqueue = private(1)
    window = [kr("h", 3), kr("a", 4), kr("b", 5)]
    standing = m.StandingAnswer(enqueue.id, 9, window, [mine(9), kr("c", 6)], 5)
    actions = waiter.feed(m.EnqueueAnswer(enqueue.id, 9, True, b"v", standing=standing))
    assert not any(isinstance(a, (m.ReadStanding, m.ReadKeys)) for a in actions)
    note = only(actions, m.Note)
    assert (note.event, note.fields) == ("queued", {"rev": 9, "position": 5, "ahead": 4})
    watch = only(actions, m.OpenWatch)
    assert (watch.key, watch.prefix) == (kr("c", 6).key, False)
    assert waiter.state == r.State.BEHIND


def test_in_the_window_it_watches_deletions_under_the_prefix_and_touches_once() -> None:
    waiter, enqueue = private(1)
    actions = queued(waiter, enqueue, [kr("h", 3)])
    assert waiter.state == r.State.IN_WINDOW
    assert kinds(actions) == [m.OpenWatch, m.Touch]
    watch, touch = only(actions, m.OpenWatch), only(actions, m.Touch)
    assert isinstance(watch, m.OpenWatch) and watch.key == PREFIX and watch.prefix
    assert isinstance(touch, m.Touch) and (touch.key, touch.revision, touch.value) == (ME, 10, b"v")
    assert waiter.feed(m.TouchAnswer(touch.id, True)) == []


def test_the_release_event_itself_hands_the_slot_over_with_no_request() -> None:
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    assert (
        waiter.feed(m.Watched(watch.id, revision=10, created=True)) == []
    )  # nothing since the read: no gap
    actions = waiter.feed(m.Watched(watch.id, [deleted(holder, 12)], 12))
    assert actions == []
    held = waiter.outcome
    assert isinstance(held, m.Held)
    assert (held.revision, held.held_at, held.retire) == (10, 12, (watch.id,))


def test_at_max_2_a_release_out_of_order_gives_the_slot_at_once() -> None:
    """N=2, holders A and B, we wait first in line: B leaves first, and that is enough."""
    waiter, enqueue = private(2)
    a, b = kr("a", 3), kr("b", 4)
    watch = only(queued(waiter, enqueue, [a, b]), m.OpenWatch)
    waiter.feed(m.Watched(watch.id, [deleted(b, 12)], 12))
    held = waiter.outcome
    assert isinstance(held, m.Held) and held.held_at == 12


def test_deletions_behind_us_and_puts_do_not_move_us_up() -> None:
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    behind = kr("z", 20)
    put = kr("h", 3, 30)
    assert waiter.feed(m.Watched(watch.id, [deleted(behind, 21), put], 30)) == []
    assert waiter.outcome is None and waiter.state == r.State.IN_WINDOW


def test_behind_the_window_it_watches_its_predecessor_then_reads_then_cancels() -> None:
    waiter, enqueue = private(1)
    ahead = [kr("h", 3), kr("w1", 4), kr("w2", 5), kr("w3", 6)]
    actions = queued(waiter, enqueue, ahead)
    assert state_of(waiter) == r.State.BEHIND
    watch = only(actions, m.OpenWatch)
    assert isinstance(watch, m.OpenWatch) and (watch.key, watch.prefix) == (ahead[-1].key, False)
    assert not any(isinstance(a, m.Touch) for a in actions)
    (read,) = waiter.feed(m.Watched(watch.id, [kr("w3", 6, 11)], 11))
    assert isinstance(read, m.ReadStanding)  # the read first, the cancel after it
    window = [*ahead[1:3], ahead[3], mine(10)]
    actions = waiter.feed(m.StandingAnswer(read.id, 11, window, [mine(10), ahead[3]]))
    assert actions[0] == m.CancelWatch(watch.id)
    assert waiter.state == r.State.IN_WINDOW


@pytest.mark.parametrize(
    ("max_holders", "owed"), [(1, m.TouchOwed.LATER), (2, m.TouchOwed.AT_ONCE)]
)
def test_a_waiter_promoted_by_a_read_owes_the_touch(max_holders: int, owed: m.TouchOwed) -> None:
    """Its hold touches: at once at N > 1 (another holder may leave any moment), a little
    into the hold at N = 1. The watch that woke it is retired by the hold."""
    waiter, enqueue = private(max_holders)
    ahead = [kr(f"k{i}", 3 + i) for i in range(r.window_size(max_holders))]
    watch = only(queued(waiter, enqueue, ahead), m.OpenWatch)
    read = only(waiter.feed(m.Watched(watch.id, [deleted(ahead[-1], 40)], 40)), m.ReadStanding)
    # Everyone ahead went at once: the read finds us holding.
    assert waiter.feed(m.StandingAnswer(read.id, 40, [mine(10)], [mine(10)])) == []
    held = waiter.outcome
    assert isinstance(held, m.Held)
    assert (held.touch, held.retire, held.held_at) == (owed, (watch.id,), 40)


def test_a_release_in_the_gap_before_the_watch_is_counted_by_the_gap_check() -> None:
    """The holder left between our read and the watch's start: the gap check, which finds
    it gone and ours there, hands the slot over at its own revision, with no second read of
    the queue (each costs etcd every key under the prefix)."""
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    (check,) = waiter.feed(m.Watched(watch.id, revision=15, created=True))
    assert isinstance(check, m.ReadKeys) and list(check.keys) == [holder.key, ME]
    assert waiter.feed(m.KeysAnswer(check.id, [None, mine(10)], 17)) == []  # the holder left
    held = waiter.outcome
    assert isinstance(held, m.Held)
    assert (held.held_at, held.retire) == (17, (watch.id,))


def test_a_gap_check_that_finds_a_key_ahead_gone_keeps_counting_the_others() -> None:
    waiter, enqueue = private(2)
    a, b, c = kr("a", 3), kr("b", 4), kr("c", 5)
    watch = only(queued(waiter, enqueue, [a, b, c]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    assert waiter.feed(m.KeysAnswer(check.id, [None, b, c, mine(10)], 16)) == []
    assert waiter.state == r.State.IN_WINDOW and waiter.outcome is None
    assert waiter.feed(m.Watched(watch.id, [deleted(a, 17)], 17)) == []  # counted once
    assert waiter.outcome is None
    assert waiter.feed(m.Watched(watch.id, [deleted(c, 18)], 18)) == []
    held = waiter.outcome
    assert isinstance(held, m.Held) and held.held_at == 18


def test_a_gap_check_that_finds_nothing_changed_keeps_waiting() -> None:
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    assert waiter.feed(m.KeysAnswer(check.id, [holder, mine(10)])) == []
    assert waiter.state == r.State.IN_WINDOW


def test_a_broken_watch_reads_the_standing_again() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    actions = waiter.feed(m.Watched(watch.id, ended=True, detail="compacted"))
    assert kinds(actions) == [m.ReadStanding]


def test_our_key_deleted_while_queued_re_enters_with_a_new_session() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    actions = waiter.feed(m.Watched(watch.id, [deleted(mine(10), 12)], 12))
    assert kinds(actions) == [m.CancelWatch, m.Withdraw]
    withdraw = only(actions, m.Withdraw)
    assert isinstance(withdraw, m.Withdraw) and withdraw.revoke
    actions = waiter.feed(m.Over(withdraw.id))
    pause = only(actions, m.Pause)
    assert any(isinstance(a, m.Note) and a.event == "requeue" for a in actions)
    (opening,) = waiter.feed(m.Over(pause.id))
    assert isinstance(opening, m.OpenSession)


def test_etcd_unreachable_for_a_moment_keeps_our_key_and_reads_again() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    read = only(
        waiter.feed(m.Watched(watch.id, ended=True, detail="stream gave up")), m.ReadStanding
    )
    actions = waiter.feed(m.Failed(read.id, m.Failure.UNREACHABLE, "connection refused"))
    assert kinds(actions) == [m.Pause]  # no withdraw, no new session
    assert waiter.state == r.State.PAUSED
    (again,) = waiter.feed(m.Over(only(actions, m.Pause).id))
    assert isinstance(again, m.ReadStanding) and (again.key, again.revision) == (ME, 10)


def test_an_enqueue_unanswered_is_sent_again_and_finds_its_own_key() -> None:
    waiter, enqueue = private(1)
    actions = waiter.feed(m.Failed(enqueue.id, m.Failure.UNREACHABLE, "timed out"))
    (again,) = waiter.feed(m.Over(only(actions, m.Pause).id))
    assert isinstance(again, m.SendEnqueue) and again.key == ME
    found = m.EnqueueAnswer(again.id, 12, False, b"old", existing=mine(9), existing_ours=True)
    (read,) = waiter.feed(found)
    assert isinstance(read, m.ReadStanding) and read.revision == 9


def test_a_touch_refused_by_the_space_alarm_keeps_our_place_and_is_tried_again() -> None:
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    actions = queued(waiter, enqueue, [holder])
    watch, touch = only(actions, m.OpenWatch), only(actions, m.Touch)
    actions = waiter.feed(m.Failed(touch.id, m.Failure.NO_SPACE, "database space exceeded"))
    assert kinds(actions) == [m.Pause] and waiter.state == r.State.IN_WINDOW
    (again,) = waiter.feed(m.Over(only(actions, m.Pause).id))
    assert isinstance(again, m.Touch)
    waiter.feed(m.Failed(again.id, m.Failure.NO_SPACE, "database space exceeded"))
    # Still in the window: the release's event hands over the slot all the same.
    waiter.feed(m.Watched(watch.id, [deleted(holder, 12)], 12))
    held = waiter.outcome
    assert isinstance(held, m.Held) and held.touch == m.TouchOwed.LATER


def test_a_lost_private_session_re_enters_at_the_back() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    actions = waiter.feed(m.SessionLost("keepalive failed"))
    assert actions[0] == m.CancelWatch(watch.id)
    withdraw = only(actions, m.Withdraw)
    assert isinstance(withdraw, m.Withdraw) and withdraw.revoke
    assert kinds(waiter.feed(m.Over(withdraw.id))) == [m.Pause]
    assert waiter.outcome is None


def shared() -> tuple[r.Waiter, m.SendEnqueue]:
    waiter = r.Waiter(PREFIX, 1, FixedPauses(), key=ME, lease_id=LEASE)
    (enqueue,) = waiter.start()
    assert isinstance(enqueue, m.SendEnqueue)
    return waiter, enqueue


def test_a_shared_session_lost_while_queued_withdraws_our_key_and_gives_up() -> None:
    waiter, enqueue = shared()
    queued(waiter, enqueue, [kr("h", 3)])
    actions = waiter.feed(m.SessionLost("lease expired"))
    withdraw = only(actions, m.Withdraw)
    assert isinstance(withdraw, m.Withdraw) and not withdraw.revoke
    assert (withdraw.key, withdraw.revision) == (ME, 10)
    waiter.feed(m.Over(withdraw.id))
    assert waiter.outcome == m.GaveUp(
        m.Reason.SESSION_LOST, "session lost while queued: lease expired"
    )


def test_a_shared_waiter_whose_key_went_checks_its_lease_before_re_entering() -> None:
    waiter, enqueue = shared()
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    actions = waiter.feed(m.Watched(watch.id, [deleted(mine(10), 12)], 12))
    check = only(actions, m.CheckLease)
    actions = waiter.feed(m.LeaseAnswer(check.id, 7))  # deleted by hand; the lease lives
    (again,) = waiter.feed(m.Over(only(actions, m.Pause).id))
    assert isinstance(again, m.SendEnqueue) and again.key == ME


def test_a_shared_waiter_whose_lease_is_gone_gives_up() -> None:
    waiter, enqueue = shared()
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, [deleted(mine(10), 12)], 12)), m.CheckLease)
    withdraw = only(waiter.feed(m.LeaseAnswer(check.id, -1)), m.Withdraw)
    waiter.feed(m.Over(withdraw.id))
    assert isinstance(waiter.outcome, m.GaveUp)
    assert waiter.outcome.reason == m.Reason.SESSION_LOST


def test_nonblock_tries_once_then_withdraws() -> None:
    """The deadline reached before the first request: the enqueue and the read are made,
    the wait is not."""
    waiter = r.Waiter(PREFIX, 1, FixedPauses())
    opening = only(waiter.start(), m.OpenSession)
    assert waiter.feed(m.DeadlineReached()) == []
    enqueue = only(waiter.feed(m.SessionOpened(opening.id, LEASE, ME)), m.SendEnqueue)
    actions = queued(waiter, enqueue, [kr("h", 3)])
    assert kinds(actions) == [m.Withdraw]
    waiter.feed(m.Over(only(actions, m.Withdraw).id))
    assert isinstance(waiter.outcome, m.GaveUp) and waiter.outcome.reason == m.Reason.NO_SLOT


def test_an_interrupt_while_waiting_cancels_the_watch_and_withdraws() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    actions = waiter.feed(m.Interrupt(15))
    assert actions[0] == m.CancelWatch(watch.id) and kinds(actions) == [m.CancelWatch, m.Withdraw]
    waiter.feed(m.Over(only(actions, m.Withdraw).id))
    assert waiter.outcome == m.GaveUp(m.Reason.INTERRUPTED, "interrupted: 15", 15)
    assert waiter.state == r.State.DONE


def test_no_session_at_all_gives_up_as_unavailable_with_nothing_to_withdraw() -> None:
    waiter = r.Waiter(PREFIX, 1, FixedPauses())
    opening = only(waiter.start(), m.OpenSession)
    failed = m.Failed(opening.id, m.Failure.UNREACHABLE, "refused")
    assert waiter.feed(failed) == []
    assert waiter.outcome == m.GaveUp(m.Reason.UNAVAILABLE, "refused", failed)


def test_a_lease_granted_after_the_wait_was_given_up_is_revoked() -> None:
    """An async driver: the grant was in flight when the interrupt came."""
    waiter = r.Waiter(PREFIX, 1, FixedPauses())
    opening = only(waiter.start(), m.OpenSession)
    assert waiter.feed(m.Interrupt("shutdown")) == []
    assert isinstance(waiter.outcome, m.GaveUp)
    (revoke,) = waiter.feed(m.SessionOpened(opening.id, LEASE, ME))
    assert isinstance(revoke, m.Withdraw) and revoke.revoke and revoke.lease_id == LEASE


def test_stale_answers_are_ignored() -> None:
    waiter, enqueue = private(1)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    (read,) = waiter.feed(m.Watched(watch.id, ended=True))[1:]
    assert waiter.feed(m.Watched(watch.id, [deleted(kr("h", 3), 12)], 12)) == []
    assert waiter.feed(m.EnqueueAnswer(enqueue.id, 10, True, b"v")) == []
    assert isinstance(read, m.ReadStanding) and waiter.outcome is None


def test_spread_busy_waits_for_the_host_key_to_change_then_enqueues_again() -> None:
    waiter, enqueue = private(1)
    other = kr("host", 4)
    actions = waiter.feed(m.EnqueueAnswer(enqueue.id, 9, False, existing=other))
    assert waiter.state == r.State.SPREAD_BUSY
    watch = only(actions, m.OpenWatch)
    assert isinstance(watch, m.OpenWatch) and (watch.key, watch.prefix) == (other.key, False)
    actions = waiter.feed(m.Watched(watch.id, [deleted(other, 11)], 11))
    assert kinds(actions) == [m.SendEnqueue, m.CancelWatch]


def test_a_watch_confirmed_resets_the_backoff() -> None:
    pauses = FixedPauses()
    waiter = r.Waiter(PREFIX, 1, pauses, key=ME, lease_id=LEASE)
    enqueue = only(waiter.start(), m.SendEnqueue)
    watch = only(queued(waiter, enqueue, [kr("h", 3)]), m.OpenWatch)
    waiter.feed(m.Watched(watch.id, revision=10, created=True))
    assert pauses.resets == 1


def test_backoff_is_jittered_capped_and_reproducible() -> None:
    """Waiters that saw one outage must not retry in lockstep."""

    def sequence(seed: int) -> list[float]:
        backoff = Backoff(first=0.1, cap=2.0, rng=random.Random(seed))
        return [backoff.next() for _ in range(20)]

    runs = [sequence(seed) for seed in range(10)]
    assert all(0.1 <= pause <= 2.0 for run in runs for pause in run)
    assert len({tuple(run[:3]) for run in runs}) == 10, "two waiters retried in lockstep"
    assert sequence(3) == sequence(3)
    assert max(runs[0][10:]) > 1.0  # it grows towards the cap
    backoff = Backoff(first=0.1, cap=2.0, rng=random.Random(1))
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert backoff.next() <= 0.3


# -- the hold's guard ----------------------------------------------------------------------


def guard(owed: m.TouchOwed = m.TouchOwed.NONE) -> g.GuardMachine:
    return g.GuardMachine(owed, revision=10, held_at=12, pauses=FixedPauses().next)


def lost(actions: Sequence[g.GuardAction]) -> bool:
    return [type(a) for a in actions] == [Loss]


def test_the_guard_plan_follows_what_the_hold_owes() -> None:
    watch_step = g.GuardAfter(g.GUARD_WATCH_DELAY, g.GuardStep.WATCH_OWN_KEY)
    plain = guard(m.TouchOwed.NONE)
    assert plain.made() == [] and plain.start() == [watch_step]
    assert plain.step(g.GuardStep.WATCH_OWN_KEY) == [g.GuardCall(g.GuardStep.WATCH_OWN_KEY, 13)]
    at_once = guard(m.TouchOwed.AT_ONCE)
    assert at_once.made() == [g.GuardAfter(0.0, g.GuardStep.TOUCH_AT_ONCE)]
    assert at_once.start() == [watch_step]
    assert at_once.step(g.GuardStep.WATCH_OWN_KEY) == [g.GuardCall(g.GuardStep.WATCH_OWN_KEY, 13)]
    later = guard(m.TouchOwed.LATER)
    assert later.made() == [] and later.start() == [watch_step]
    assert g.TOUCH_DELAY > g.GUARD_WATCH_DELAY
    assert later.step(g.GuardStep.WATCH_OWN_KEY) == [
        g.GuardAfter(g.TOUCH_DELAY - g.GUARD_WATCH_DELAY, g.GuardStep.TOUCH_DUE),
        g.GuardCall(g.GuardStep.WATCH_OWN_KEY, 13),
    ]


def test_what_the_guard_makes_of_a_notice_a_look_and_a_touch() -> None:
    look = [g.GuardAfter(1.0, g.GuardStep.LOOK)]
    assert lost(guard().notice(ended=False))  # a deletion of our key
    assert guard().notice(ended=True) == look  # compacted, stream gave up
    released = guard()
    released.release()
    assert released.notice(ended=False) == [] and released.lost is None  # our own release
    assert guard().looked(mine(10), 30) == [g.GuardCall(g.GuardStep.WATCH_OWN_KEY, 31)]
    assert lost(guard().looked(mine(12), 30))  # a key of that name, not ours
    assert lost(guard().looked(None, 30))
    assert released.looked(None, 30) == [] and released.lost is None
    touched = guard(m.TouchOwed.AT_ONCE)  # ours at the touch: the watch starts from there
    assert touched.touched(g.GuardStep.TOUCH_AT_ONCE, 20, succeeded=True) == []
    touched.start()
    assert touched.step(g.GuardStep.WATCH_OWN_KEY) == [g.GuardCall(g.GuardStep.WATCH_OWN_KEY, 21)]
    assert touched.lost is None
    assert lost(guard().touched(g.GuardStep.TOUCH_DUE, 20, succeeded=False))
    retry = guard().touch_failed(g.GuardStep.TOUCH_DUE, "etcd away")  # or the space alarm
    assert retry[1:] == [g.GuardAfter(1.0, g.GuardStep.TOUCH_DUE)]
    assert released.touched(g.GuardStep.TOUCH_DUE, 20, succeeded=False) == []
    assert released.lost is None


def test_a_gap_check_answered_after_an_event_moved_us_up_judges_the_keys_still_watched() -> None:
    """An async driver: the deletion of the first key ahead arrives while the gap check is
    in flight. The check's answer (that key absent) is no change any more."""
    waiter, enqueue = private(2)
    a, b, c = kr("a", 3), kr("b", 4), kr("c", 5)
    watch = only(queued(waiter, enqueue, [a, b, c]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    assert waiter.feed(m.Watched(watch.id, [deleted(a, 16)], 16)) == []
    assert waiter.feed(m.KeysAnswer(check.id, [None, b, c, mine(10)])) == []
    assert waiter.state == r.State.IN_WINDOW and waiter.outcome is None


def test_a_release_before_the_gap_check_answers_never_holds_a_key_gone_in_the_gap() -> None:
    """Found by the simulator (seed 1568): read at R = 10, the watch confirmed at C = 15,
    the gap check sent; the holder's release arrives on the watch before its answer, and
    the answer says our key went in (R, C], a deletion the watch from "now" never shows.
    The release must not count before the answer: the waiter reads again, never holds."""
    waiter, enqueue = shared()
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    assert waiter.feed(m.Watched(watch.id, [deleted(holder, 16)], 16)) == []
    assert waiter.outcome is None and waiter.state == r.State.IN_WINDOW
    actions = waiter.feed(m.KeysAnswer(check.id, [None, None]))  # both gone: ours in the gap
    assert kinds(actions) == [m.ReadStanding, m.CancelWatch]
    assert waiter.outcome is None
    read = only(actions, m.ReadStanding)
    actions = waiter.feed(m.StandingAnswer(read.id, 16, [], []))
    assert isinstance(only(actions, m.CheckLease), m.CheckLease) and waiter.outcome is None


def test_a_release_held_back_by_the_gap_check_hands_the_slot_over_once_it_answers() -> None:
    """The same race with nothing changed in the gap: the held-back release is counted as
    the check answers, with no further request (its revision is the hold's)."""
    waiter, enqueue = private(1)
    holder = kr("h", 3)
    watch = only(queued(waiter, enqueue, [holder]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    assert waiter.feed(m.Watched(watch.id, [deleted(holder, 16)], 16)) == []
    assert waiter.outcome is None
    assert waiter.feed(m.KeysAnswer(check.id, [None, mine(10)])) == []
    held = waiter.outcome
    assert isinstance(held, m.Held)
    assert (held.held_at, held.retire) == (16, (watch.id,))


def test_a_read_refused_as_compacted_is_read_again_at_once_without_a_warning() -> None:
    """A gap check pinned to a revision compaction just passed: etcd answered, so no
    etcd-away warning and no pause; the waiter reads again from the present. A second
    refusal running pauses, warned, as any failure does."""
    waiter, enqueue = private(2)
    watch = only(queued(waiter, enqueue, [kr("a", 3), kr("b", 4)]), m.OpenWatch)
    check = only(waiter.feed(m.Watched(watch.id, revision=15, created=True)), m.ReadKeys)
    actions = waiter.feed(m.Failed(check.id, m.Failure.COMPACTED, "compacted"))
    assert kinds(actions) == [m.CancelWatch, m.ReadStanding]
    read = only(actions, m.ReadStanding)
    actions = waiter.feed(m.Failed(read.id, m.Failure.COMPACTED, "compacted"))
    assert [a.event for a in actions if isinstance(a, m.Note)] == ["etcd-away"]
    only(actions, m.Pause)


def test_a_run_of_failures_is_logged_once_until_etcd_answers() -> None:
    """The space alarm may last hours: one warning per run of refusals, not one a pause."""
    waiter, enqueue = private(1)
    notes: list[str] = []
    for _ in range(3):
        actions = waiter.feed(m.Failed(enqueue.id, m.Failure.NO_SPACE, "space"))
        notes += [a.event for a in actions if isinstance(a, m.Note)]
        enqueue = only(waiter.feed(m.Over(only(actions, m.Pause).id)), m.SendEnqueue)
    assert notes == ["etcd-away"]
    touch = only(queued(waiter, enqueue, [kr("h", 3)]), m.Touch)
    for _ in range(3):
        actions = waiter.feed(m.Failed(touch.id, m.Failure.NO_SPACE, "space"))
        notes += [a.event for a in actions if isinstance(a, m.Note)]
        touch = only(waiter.feed(m.Over(only(actions, m.Pause).id)), m.Touch)
    assert notes == ["etcd-away", "touch-failed"]


# -- any input at any moment ---------------------------------------------------------------


def _answer(action: m.Action, rng: random.Random, keys: list[m.KeyRev]) -> m.Input | None:
    """A plausible answer to ``action``, or a failure of it; None for what has none."""
    if isinstance(action, (m.CancelWatch, m.Note)):
        return None
    failure = rng.random() < 0.2
    if failure and not isinstance(action, (m.Withdraw, m.Pause, m.OpenWatch)):
        return m.Failed(action.id, rng.choice(list(m.Failure)), "fault")
    revision = rng.randint(1, 50)
    if isinstance(action, m.OpenSession):
        return m.SessionOpened(action.id, LEASE, ME)
    if isinstance(action, m.SendEnqueue):
        created = rng.random() < 0.7
        ahead = sorted(rng.sample(keys, rng.randint(0, len(keys))), key=lambda k: k.create_revision)
        at = [*ahead, mine(revision)]
        read = m.StandingAnswer(action.id, revision, at[:5], at[::-1][:2], len(at))
        standing = rng.choice([None, read])
        found = rng.choice([None, mine(9), kr("host", 4)])
        return m.EnqueueAnswer(
            action.id, revision, created, b"v", standing, found, found == mine(9)
        )
    if isinstance(action, m.ReadStanding):
        ahead = sorted(rng.sample(keys, rng.randint(0, len(keys))), key=lambda k: k.create_revision)
        me = [mine(action.revision)] if rng.random() < 0.9 else []
        return m.StandingAnswer(action.id, revision, [*ahead, *me][:5], [*me, *ahead[-1:]])
    if isinstance(action, m.ReadKeys):
        return m.KeysAnswer(action.id, [rng.choice([None, *keys]) for _ in action.keys])
    if isinstance(action, m.Touch):
        return m.TouchAnswer(action.id, rng.random() < 0.8)
    if isinstance(action, m.CheckLease):
        return m.LeaseAnswer(action.id, rng.choice([-1, 5]))
    if isinstance(action, m.Withdraw):
        return m.Over(action.id)
    if isinstance(action, m.Pause):
        return m.Over(action.id)
    if isinstance(action, m.OpenWatch):
        if rng.random() < 0.5:
            return m.Watched(action.id, revision=revision, created=True)
        if rng.random() < 0.1:
            return m.Watched(action.id, ended=True)
        key = rng.choice([*keys, mine(10)])
        return m.Watched(action.id, [replace(key, deleted=rng.random() < 0.5)], revision)
    raise AssertionError(action)


@pytest.mark.parametrize("seed", range(300))
def test_any_input_at_any_moment_leaves_the_machine_consistent(seed: int) -> None:
    """Seeded schedules of plausible answers, failures, stale ids, watch events, losses,
    deadlines and pauses in any order: the machine never raises, its outcome once given
    never changes, and an interrupt ends any wait once its withdraw is answered."""
    rng = random.Random(seed)
    keys = [kr(f"k{i}", 3 + i) for i in range(rng.randint(0, 6))]
    max_holders = rng.randint(1, 3)
    if rng.random() < 0.5:
        waiter = r.Waiter(PREFIX, max_holders, FixedPauses(), key=ME, lease_id=LEASE)
    else:
        waiter = r.Waiter(PREFIX, max_holders, FixedPauses())
    pending = list(waiter.start())
    outcome: m.Outcome | None = None
    for _ in range(150):
        if pending and rng.random() < 0.7:
            answer = _answer(pending.pop(rng.randrange(len(pending))), rng, keys)
        else:
            answer = rng.choice(
                [
                    m.SessionLost("x"),
                    m.DeadlineReached(),
                    m.Over(rng.randint(1, 40)),
                    m.Over(rng.randint(1, 40)),
                    m.Watched(rng.randint(1, 40), [replace(mine(10), deleted=True)], 9),
                    m.Failed(rng.randint(1, 40), m.Failure.UNREACHABLE),
                    None,
                ]
            )
        if answer is not None:
            pending += waiter.feed(answer)
        if outcome is not None:
            assert waiter.outcome is outcome, "the outcome changed"
        outcome = waiter.outcome
        assert waiter.state in (r.State.HELD, r.State.DONE) or outcome is None
    pending += waiter.feed(m.Interrupt(2))
    for _ in range(20):
        if waiter.outcome is not None:
            break
        withdraws = [a for a in pending if isinstance(a, m.Withdraw)]
        pending = [a for a in pending if not isinstance(a, m.Withdraw)]
        for withdraw in withdraws:
            pending += waiter.feed(m.Over(withdraw.id))
        if not withdraws and pending:
            answer = _answer(pending.pop(0), rng, keys)
            if answer is not None:
                pending += waiter.feed(answer)
    assert waiter.outcome is not None, waiter.state
