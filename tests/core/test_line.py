"""conch.core.line: which waiters of one process read their standing, and when the parked
ones may (pure: no etcd)."""

from __future__ import annotations

from conch.core.line import Line
from conch.core.messages import KeyRev


def test_a_waiter_whose_key_is_not_known_yet_counts_as_ahead() -> None:
    """Answers to a burst's enqueues come in any order: one placed first must not read
    while those whose keys may be ahead of it are still unknown."""
    line: Line[str] = Line(limit=1)
    assert [line.joined(m) for m in "ab"] == [True, False]
    assert line.placed("b", 9) == []
    assert line.park("b", 9)  # a's key may come before b's
    assert line.placed("a", 8) == []  # it did: b waits for a
    assert line.leave("a") == ["b"]


def test_past_the_limit_a_waiter_parks_until_one_ahead_leaves() -> None:
    line: Line[str] = Line(limit=2)
    assert [line.joined(m) for m in "abcd"] == [True, True, False, False]
    for member, revision in zip("abcd", (10, 11, 12, 13), strict=True):
        assert line.placed(member, revision) == []
    assert not line.park("a", 10) and not line.park("b", 11)
    assert line.park("c", 12) and line.park("d", 13)
    assert line.leave("a") == ["c"]  # b and c are the two first now; d stays parked
    assert line.leave("c") == ["d"]
    assert line.leave("b") == [] and line.leave("d") == [] and len(line) == 0


def test_the_parked_ones_read_in_their_keys_order_whoever_leaves() -> None:
    line: Line[str] = Line(limit=1)
    for member, revision in zip("abc", (5, 7, 9), strict=True):
        line.joined(member)
        line.placed(member, revision)
    assert line.park("c", 9) and line.park("b", 7)
    assert line.leave("c") == []  # c was behind b: a still waits, b stays parked
    assert line.leave("a") == ["b"]


def test_a_key_placed_again_moves_its_waiter_and_one_that_leaves_parked_is_gone() -> None:
    line: Line[str] = Line(limit=1)
    for member, revision in zip("ab", (5, 7), strict=True):
        line.joined(member)
        line.placed(member, revision)
    assert line.park("b", 7)
    # a lost its key and re-enters: while its new key is unknown it counts as ahead of b
    assert line.placed("a", 0) == []
    assert line.placed("a", 8) == ["b"]  # behind b now: b is first
    assert line.park("a", 8)
    assert line.leave("a") == []  # its deadline came: parked or not, it is out
    assert line.leave("b") == [] and len(line) == 0


def test_the_head_read_loses_only_keys_deleted_after_it() -> None:
    """A deletion at or before the read's revision may be of an earlier key of that name
    (one of our session's names, reused): the key the read found stays."""
    line: Line[str] = Line(limit=2)
    line.head = 20, [KeyRev(b"a", 5, 5), KeyRev(b"b", 6, 6), KeyRev(b"c", 7, 7)]
    line.seen([KeyRev(b"a", 0, 21, deleted=True), KeyRev(b"b", 0, 19, deleted=True)])
    assert line.head == (20, [KeyRev(b"b", 6, 6), KeyRev(b"c", 7, 7)])
    line.seen([KeyRev(b"c", 0, 22)])  # a put (a touch) leaves it
    assert [k.key for k in line.head[1]] == [b"b", b"c"]
