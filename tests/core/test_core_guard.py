"""The guard machine (``conch.core.guard.GuardMachine``) on its own inputs: its schedule,
what a notice, a look and a touch's answer mean, and what it logs. Both faces' Holds
execute it (tests/library/test_loss.py and test_parity.py run them against real etcd)."""

from __future__ import annotations

from conch.core.guard import (
    GUARD_WATCH_DELAY,
    TOUCH_DELAY,
    GuardAction,
    GuardAfter,
    GuardCall,
    GuardMachine,
    GuardStep,
)
from conch.core.loss import NOT_CONFIRMED, Loss, LossReason
from conch.core.messages import KeyRev, Note, TouchOwed


def machine(owed: TouchOwed = TouchOwed.NONE) -> GuardMachine:
    # Pauses of one length, so that the actions compare equal.
    return GuardMachine(owed, revision=10, held_at=12, pauses=lambda: 0.25)


def test_a_hold_that_owes_its_touch_at_once_touches_before_its_guard_starts() -> None:
    guard = machine(TouchOwed.AT_ONCE)
    assert guard.made() == [GuardAfter(0.0, GuardStep.TOUCH_AT_ONCE)]
    assert guard.step(GuardStep.TOUCH_AT_ONCE) == [GuardCall(GuardStep.TOUCH_AT_ONCE)]
    assert guard.touched(GuardStep.TOUCH_AT_ONCE, revision=15, succeeded=True) == []
    assert guard.start() == [GuardAfter(GUARD_WATCH_DELAY, GuardStep.WATCH_OWN_KEY)]
    assert guard.start() == []  # idempotent
    # Ours at the touch: the watch starts after it, with nothing before it to replay.
    assert guard.step(GuardStep.WATCH_OWN_KEY) == [GuardCall(GuardStep.WATCH_OWN_KEY, 16)]


def test_a_max_1_hold_that_waited_touches_touch_delay_into_the_hold() -> None:
    guard = machine(TouchOwed.LATER)
    assert guard.made() == []
    guard.start()
    assert guard.step(GuardStep.WATCH_OWN_KEY) == [
        GuardAfter(TOUCH_DELAY - GUARD_WATCH_DELAY, GuardStep.TOUCH_DUE),
        GuardCall(GuardStep.WATCH_OWN_KEY, 13),
    ]


def test_touch_failed_is_said_once_per_run_of_failures_and_the_touch_retried() -> None:
    guard = machine(TouchOwed.LATER)
    said: list[GuardAction] = []
    for _ in range(4):
        actions = guard.touch_failed(GuardStep.TOUCH_DUE, "etcd away")
        assert GuardAfter(0.25, GuardStep.TOUCH_DUE) in actions
        said += [a for a in actions if isinstance(a, Note)]
    assert said == [Note("touch-failed", {"error": "etcd away"}, warning=True)]
    assert guard.touched(GuardStep.TOUCH_DUE, 20, succeeded=True) == []
    again = guard.touch_failed(GuardStep.TOUCH_DUE, "etcd away")
    assert [a for a in again if isinstance(a, Note)], "a new run of failures is said again"
    assert guard.lost is None


def test_a_notice_of_our_key_s_deletion_loses_the_hold_an_ended_watch_looks() -> None:
    guard = machine()
    assert guard.notice(ended=True) == [GuardAfter(0.25, GuardStep.LOOK)]
    assert guard.step(GuardStep.LOOK) == [GuardCall(GuardStep.LOOK)]
    assert guard.looked(KeyRev(b"k", 10, 30), revision=31) == [
        GuardCall(GuardStep.WATCH_OWN_KEY, 32)
    ]
    (lost,) = guard.notice(ended=False)
    assert isinstance(lost, Loss) and lost.reason is LossReason.KEY_DELETED
    assert guard.done and guard.notice(ended=False) == [] and guard.step(GuardStep.LOOK) == []


def test_a_look_that_finds_another_key_in_our_place_loses_the_hold() -> None:
    (lost,) = machine().looked(KeyRev(b"k", 44, 44), revision=50)
    assert isinstance(lost, Loss) and lost.reason.slot_taken


def test_a_release_makes_the_deletion_no_loss_and_the_session_s_loss_is_kept_as_it_came() -> None:
    guard = machine()
    guard.release()
    assert guard.notice(ended=False) == [] and guard.looked(None, 5) == []
    assert guard.session_ended(NOT_CONFIRMED) == []
    other = machine()
    (lost,) = other.session_ended(NOT_CONFIRMED)
    assert isinstance(lost, Loss) and lost.reason is LossReason.NO_KEEPALIVE
    assert other.write_refused() == []  # lost already: said once
