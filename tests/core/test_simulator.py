"""The recipe's simulator (tests/sim): the recipe's machines (conch.core.waiter.Waiter)
driven through seeded schedules on the model of etcd with every property checked at each
step, and the checks themselves shown to catch known mistakes. The model itself is checked
against a real etcd by tests/core/test_model.py.

A failing seed replays exactly: ``scripts/simulate.py --replay SEED`` prints its trace.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import pytest

from conch.core import codec
from conch.core import waiter as recipe
from tests.sim import variants
from tests.sim.schedule import RELEASES, PropertyFailed, cost_per_release, drain_under_alarm, run

# Schedules in CI: SEEDS seeds in CHUNKS tests; about 6-10 ms of CPU each (measured with
# `scripts/simulate.py --seeds 2000`: 12.5 s to 46.0 s on the shared 2-core machine, at
# loads of about 4 to 13), so the file's wall time stays under a minute there (28-48 s).
SEEDS = 2000
CHUNKS = 10
# Seeds whose schedules reach the gap: a key deleted between the waiter's queue read and its
# watch's start, with a window event arriving before its gap check has answered. The recipe
# once counted that event and held the deleted key (found by seeds 1568 and 1698 of the
# schedules then; docs/design.md, "What the simulator explores"); the Waiter as it was
# (variants.CountsBeforeGapCheck) fails these, its first three seeds, today, and the test
# checks it still does, so that the fix's own test keeps reaching the gap as the schedules change.
GAP_SEEDS = frozenset({82, 245, 298})


def _failures(
    seeds: Iterable[int],
    waiter: type[recipe.Waiter],
    reader: type[codec.ReadTogether] = codec.ReadTogether,
) -> list[str]:
    failed = []
    for seed in sorted(seeds):
        try:
            run(seed, waiter=waiter, reader=reader)
        except PropertyFailed as failure:
            failed.append(str(failure))
    return failed


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_recipe_keeps_its_properties_on_fixed_seeds(chunk: int) -> None:
    size = SEEDS // CHUNKS
    seeds = range(chunk * size, (chunk + 1) * size)
    failed = _failures(seeds, recipe.Waiter)
    assert not failed, f"{len(failed)} schedules failed; the first:\n{failed[0]}"


def test_a_key_deleted_in_the_gap_before_the_watch_is_never_held() -> None:
    failed = _failures(GAP_SEEDS, recipe.Waiter)
    assert not failed, f"{len(failed)} schedules failed; the first:\n{failed[0]}"
    before_the_fix = _failures(GAP_SEEDS, variants.CountsBeforeGapCheck)
    assert len(before_the_fix) == len(GAP_SEEDS), "the seeds no longer reach the gap: find others"
    assert all("a key deleted at" in message for message in before_the_fix), before_the_fix[0]


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        ("over-counting", "FIFO"),
        ("no-gap-check", "sleeps in state"),
        ("no-rewatch", "sleeps in state"),
        ("no-withdraw", "still kept alive"),
    ],
)
def test_each_known_mistake_is_caught(variant: str, caught_by: str) -> None:
    """A property no schedule can fail proves nothing: each broken Waiter fails some of
    the first 100 schedules, on the property meant to catch it."""
    failed = _failures(range(100), variants.BROKEN[variant])
    assert failed, f"{variant}: no schedule failed"
    assert any(caught_by in message for message in failed), failed[0]


def test_a_read_plan_without_the_space_fallback_is_caught() -> None:
    """Reads that stay a read-only Txn which etcd refuses at its space quota (conch's
    asyncio face once): some of the first 100 schedules fail on it."""
    failed = _failures(range(100), recipe.Waiter, variants.NoSpaceFallback)
    assert failed, "no schedule failed"
    assert all("refused under the space alarm" in message for message in failed), failed[0]


@pytest.mark.parametrize("version", RELEASES)
def test_under_the_space_alarm_each_waiter_holds_in_turn(version: str) -> None:
    """One holder at max 1 and six waiters queued, then the backend at its quota: each
    release still hands the slot to the next, in order (on every release's alarm, through
    the shipped codec's read plan)."""
    assert drain_under_alarm(version, waiters=6) == [f"w{i}" for i in range(7)]


def test_the_schedules_explore_every_input_and_fault() -> None:
    """Over 200 seeds the schedules reach every state and input the recipe handles (not
    only holds at the enqueue): a drift in the scheduler that stopped exploring shows."""
    counts: collections.Counter[str] = collections.Counter()
    for seed in range(200):
        counts += run(seed).counts
    for needed in (
        "state.IN_WINDOW",
        "state.BEHIND",
        "state.PAUSED",
        "held.IN_WINDOW.AT_ONCE",
        "held.IN_WINDOW.LATER",
        "held.IN_WINDOW.NONE",
        "held.READING.AT_ONCE",
        "Touch",
        "ReadKeys",
        "CheckLease",
        "Watched.ended",
        "SessionLost",
        "Interrupt",
        "DeadlineReached",
        "Failed.UNREACHABLE",
        "Failed.NO_SPACE",
        "Failed.LEASE_NOT_FOUND",
        "world.burst",
        "world.lose",
        "world.outside",
        "world.unreachable",
        "world.restart",
        "world.nospace",
        "world.compact",
        "world.break",
        "release.3.5.1",
        "release.3.5.7",
        "release.3.4.23",
        "release.3.4.19",
        "read.TXN",
        "read.PINNED_RANGES",
        "read.fell-back",
        "SendKeepalive",
        "keepalive.unanswered",
        "Expired",
        "Lost",
        "GuardCall.TOUCH_DUE",
        "GuardCall.LOOK",
        "Loss",
    ):
        assert counts[needed] >= 3, f"{needed}: {counts[needed]} in 200 schedules"


def test_a_seed_replays_exactly() -> None:
    first, again = run(1234), run(1234)
    assert first.trace == again.trace
    assert len(first.trace) > 50


@pytest.mark.parametrize("max_holders", [1, 2, 5, 9])
def test_a_release_costs_the_same_whatever_the_queue(max_holders: int) -> None:
    """Requests to etcd and watch notices per release, from the release until all is
    settled: at most 4 requests (the revoke, the last window waiter's touch, the joining
    waiter's read and watch) and one notice per window waiter plus the touch's, for a
    queue just longer than the window and for one of 40."""
    window_waiters = recipe.window_size(max_holders) - max_holders
    short = cost_per_release(max_holders, window_waiters + 2, 2)
    long = cost_per_release(max_holders, 40, 30)
    for requests, notices in short + long:
        assert requests <= 4
        assert notices <= window_waiters + 1
    assert max(long) == max(short)
