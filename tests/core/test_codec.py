"""The codec (conch/core/codec.py) without etcd: the requests it builds for the Waiter's
actions, how it reads etcd's answers, its read plan by etcd release and under the space
alarm, and its one failure table."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.core import codec
from conch.core import messages as m
from conch.errors import Compacted, EtcdError, LeaseNotFound, PermissionDenied, Unavailable

PREFIX = b"/conch/v1/sema/x/1/"
KEY = PREFIX + b"abc"
NO_SPACE = EtcdError("etcdserver: mvcc: database space exceeded", "RESOURCE_EXHAUSTED")


def header(revision: int) -> rpc_pb2.ResponseHeader:
    return rpc_pb2.ResponseHeader(revision=revision)


@pytest.mark.parametrize(
    ("version", "plan"),
    [
        ("3.5.0", codec.ReadPlan.PINNED_RANGES),
        ("3.5.1", codec.ReadPlan.PINNED_RANGES),
        ("3.5.4", codec.ReadPlan.PINNED_RANGES),  # issue 14110's panic, fixed in 3.5.5
        ("3.5.6", codec.ReadPlan.PINNED_RANGES),  # issue 14891's crash, fixed in 3.5.7
        ("3.5.7", codec.ReadPlan.TXN),
        ("3.5.17", codec.ReadPlan.TXN),
        ("3.4.23", codec.ReadPlan.TXN),  # no request context reaches 3.4's apply
        ("3.6.0", codec.ReadPlan.TXN),
        ("not-a-version", codec.ReadPlan.PINNED_RANGES),
        (None, codec.ReadPlan.PINNED_RANGES),  # Maintenance.Status did not answer
    ],
)
def test_the_read_plan_avoids_the_read_only_txn_on_releases_it_crashes(
    version: str | None, plan: codec.ReadPlan
) -> None:
    assert codec.read_plan(version) == plan


def two_reads() -> list[rpc_pb2.RangeRequest]:
    return codec.standing_reads(m.ReadStanding(1, KEY, 7), PREFIX, 1)


def test_ranges_read_together_are_one_read_only_txn() -> None:
    read = codec.ReadTogether(two_reads(), codec.ReadPlan.TXN)
    call = read.next_call()
    assert call is not None and call.method == "Txn"
    assert isinstance(call.request, rpc_pb2.TxnRequest)
    assert not call.request.compare and not call.request.failure
    assert [op.request_range for op in call.request.success] == two_reads()
    one = rpc_pb2.RangeResponse(kvs=[kv_pb2.KeyValue(key=KEY, create_revision=7)])
    response = rpc_pb2.TxnResponse(
        header=header(9),
        succeeded=True,
        responses=[rpc_pb2.ResponseOp(response_range=one)] * 2,
    )
    read.answer(response)
    assert read.next_call() is None
    assert read.result == codec.Together(9, [one, one])


def test_a_read_only_txn_refused_under_the_space_alarm_is_read_as_pinned_ranges() -> None:
    read = codec.ReadTogether(two_reads(), codec.ReadPlan.TXN)
    assert read.next_call() is not None
    read.refused(NO_SPACE)  # does not raise: read another way
    assert read.plan == codec.ReadPlan.PINNED_RANGES
    first = read.next_call()
    assert first is not None and first.method == "Range"
    assert first.request == two_reads()[0]  # at the current revision
    read.answer(rpc_pb2.RangeResponse(header=header(12)))
    second = read.next_call()
    assert second is not None and second.method == "Range"
    assert isinstance(second.request, rpc_pb2.RangeRequest)
    assert second.request.revision == 12  # pinned to the first's
    assert second.request.limit == two_reads()[1].limit
    read.answer(rpc_pb2.RangeResponse(header=header(12)))
    assert read.next_call() is None
    assert read.result.revision == 12 and len(read.result.responses) == 2


@pytest.mark.parametrize(
    "error", [Unavailable("gone"), PermissionDenied("no", "PERMISSION_DENIED")]
)
def test_a_read_refused_otherwise_raises_the_error(error: EtcdError) -> None:
    read = codec.ReadTogether(two_reads(), codec.ReadPlan.TXN)
    read.next_call()
    with pytest.raises(type(error)):
        read.refused(error)


def test_pinned_ranges_refused_raise_even_under_the_alarm() -> None:
    read = codec.ReadTogether(two_reads(), codec.ReadPlan.PINNED_RANGES)
    call = read.next_call()
    assert call is not None and call.method == "Range"
    with pytest.raises(EtcdError):
        read.refused(NO_SPACE)


def test_a_pinned_standing_read_whose_window_holds_our_key_reads_one_range() -> None:
    """At the head (ours in the window, as its last key: none created after ours is read),
    the Range of ours and the one ahead would read the window's last two: it is not sent,
    and the answer is the one the two Ranges give."""
    action = m.ReadStanding(1, KEY, 7)
    ahead = kv_pb2.KeyValue(key=PREFIX + b"a", create_revision=5)
    ours = kv_pb2.KeyValue(key=KEY, create_revision=7)
    window = rpc_pb2.RangeResponse(header=header(9), kvs=[ahead, ours])
    read = codec.ReadTogether(codec.standing_reads(action, PREFIX, 1), codec.ReadPlan.PINNED_RANGES)
    first = read.next_call()
    assert first is not None and first.method == "Range"
    read.answer(window)
    assert read.next_call() is None
    both = codec.Together(9, [window, rpc_pb2.RangeResponse(kvs=[ours, ahead])])
    assert codec.standing_answer(action, read.result) == codec.standing_answer(action, both)
    # Ours not in the window (behind it, or gone): the second Range is read.
    read = codec.ReadTogether(codec.standing_reads(action, PREFIX, 1), codec.ReadPlan.PINNED_RANGES)
    read.next_call()
    read.answer(rpc_pb2.RangeResponse(header=header(9), kvs=[ahead]))
    second = read.next_call()
    assert second is not None and isinstance(second.request, rpc_pb2.RangeRequest)
    assert second.request.revision == 9


def test_the_keys_ahead_are_counted_by_etcd_and_read_only_when_that_revision_is_compacted() -> None:
    counting = codec.count_ahead(PREFIX, 9)
    counted = next(counting).request
    assert isinstance(counted, rpc_pb2.RangeRequest)
    assert counted.count_only and counted.revision == 8 and not counted.max_create_revision
    with pytest.raises(StopIteration) as stop:
        counting.send(rpc_pb2.RangeResponse(count=4))
    assert stop.value.value == 4
    counting = codec.count_ahead(PREFIX, 9)
    next(counting)
    read = counting.throw(Compacted("compacted", 9)).request
    assert isinstance(read, rpc_pb2.RangeRequest)
    assert read.keys_only and read.max_create_revision == 8 and not read.revision
    with pytest.raises(StopIteration) as stop:
        counting.send(rpc_pb2.RangeResponse(count=7, kvs=[kv_pb2.KeyValue(key=KEY)] * 2))
    assert stop.value.value == 2


def test_the_standing_reads_are_the_window_and_our_key_with_the_one_ahead() -> None:
    window, mine_and_prev = two_reads()
    for read in (window, mine_and_prev):
        assert (read.key, read.range_end) == (PREFIX, b"/conch/v1/sema/x/10")
        assert read.keys_only and read.max_create_revision == 7
        assert read.sort_target == rpc_pb2.RangeRequest.CREATE
    assert (window.limit, window.sort_order) == (3, rpc_pb2.RangeRequest.ASCEND)
    assert (mine_and_prev.limit, mine_and_prev.sort_order) == (2, rpc_pb2.RangeRequest.DESCEND)


def test_the_enqueue_is_one_create_if_absent_txn_and_its_answers_read_so() -> None:
    action = m.SendEnqueue(1, KEY, 0x51)
    call = codec.enqueue_call(action, PREFIX, 2, b"{}")
    txn = call.request
    assert isinstance(txn, rpc_pb2.TxnRequest) and call.method == "Txn"
    assert txn.compare[0].target == rpc_pb2.Compare.CREATE and txn.compare[0].create_revision == 0
    assert txn.success[0].request_put == rpc_pb2.PutRequest(key=KEY, value=b"{}", lease=0x51)
    window, mine_and_prev, counted = (op.request_range for op in txn.success[1:])
    assert (window.limit, window.sort_order, window.keys_only) == (
        5,
        rpc_pb2.RangeRequest.ASCEND,
        True,
    )
    assert (mine_and_prev.limit, mine_and_prev.sort_order) == (2, rpc_pb2.RangeRequest.DESCEND)
    assert counted.count_only and (counted.key, counted.range_end) == (window.key, window.range_end)
    assert txn.failure[0].request_range == rpc_pb2.RangeRequest(key=KEY)

    ahead = kv_pb2.KeyValue(key=b"/conch/v1/sema/x/1/a", create_revision=4, mod_revision=4)
    ours = kv_pb2.KeyValue(key=KEY, create_revision=5, mod_revision=5)
    ranges = [
        rpc_pb2.RangeResponse(kvs=[ahead, ours]),
        rpc_pb2.RangeResponse(kvs=[ours, ahead]),
        rpc_pb2.RangeResponse(count=2),
    ]
    put = rpc_pb2.ResponseOp(response_put=rpc_pb2.PutResponse())
    created = rpc_pb2.TxnResponse(
        header=header(5),
        succeeded=True,
        responses=[put, *(rpc_pb2.ResponseOp(response_range=r) for r in ranges)],
    )
    a, me = m.KeyRev(ahead.key, 4, 4), m.KeyRev(KEY, 5, 5)
    standing = m.StandingAnswer(1, 5, [a, me], [me, a], 2)
    assert codec.enqueue_answer(action, created, b"{}") == m.EnqueueAnswer(
        1, 5, True, b"{}", standing=standing
    )
    mine = kv_pb2.KeyValue(key=KEY, create_revision=3, mod_revision=4, lease=0x51, value=b"v")
    found = rpc_pb2.TxnResponse(
        header=header(6),
        responses=[rpc_pb2.ResponseOp(response_range=rpc_pb2.RangeResponse(kvs=[mine]))],
    )
    assert codec.enqueue_answer(action, found, b"{}") == m.EnqueueAnswer(
        1, 6, False, b"v", existing=m.KeyRev(KEY, 3, 4), existing_ours=True
    )
    gone = rpc_pb2.TxnResponse(
        header=header(6), responses=[rpc_pb2.ResponseOp(response_range=rpc_pb2.RangeResponse())]
    )
    assert codec.enqueue_answer(action, gone, b"{}") == m.EnqueueAnswer(1, 6, False)


def test_a_withdraw_compares_the_create_revision_or_when_unknown_the_lease() -> None:
    by_rev = codec.withdraw_call(m.Withdraw(1, KEY, 7, 0x51, False)).request
    assert isinstance(by_rev, rpc_pb2.TxnRequest)
    assert by_rev.compare[0].target == rpc_pb2.Compare.CREATE
    assert by_rev.compare[0].create_revision == 7
    by_lease = codec.withdraw_call(m.Withdraw(1, KEY, 0, 0x51, False)).request
    assert isinstance(by_lease, rpc_pb2.TxnRequest)
    assert (by_lease.compare[0].target, by_lease.compare[0].lease) == (rpc_pb2.Compare.LEASE, 0x51)
    for txn in (by_rev, by_lease):
        assert txn.success[0].request_delete_range.key == KEY


def test_the_touch_re_puts_our_key_if_it_is_still_ours() -> None:
    call = codec.touch_call(KEY, 7, b"v", 0x51)
    txn = call.request
    assert isinstance(txn, rpc_pb2.TxnRequest)
    assert (txn.compare[0].target, txn.compare[0].create_revision) == (rpc_pb2.Compare.CREATE, 7)
    assert txn.success[0].request_put == rpc_pb2.PutRequest(key=KEY, value=b"v", lease=0x51)
    refused = rpc_pb2.TxnResponse(header=header(8), succeeded=False)
    assert codec.touch_answer(m.Touch(2, KEY, 7, b"v", 0x51), refused) == m.TouchAnswer(2, False)


class Notice(NamedTuple):
    error: Exception | None = None
    created: bool = False
    revision: int = 0
    events: tuple[kv_pb2.Event, ...] = ()


def test_watch_notices_become_the_machine_s_inputs() -> None:
    assert codec.watch_input(3, Notice(created=True, revision=9)) == m.Watched(
        3, revision=9, created=True
    )
    broken = codec.watch_input(3, Notice(error=Compacted("compacted", 4)))
    assert broken.ended and broken.detail == str(Compacted("compacted", 4))
    deleted = kv_pb2.Event(type=kv_pb2.Event.DELETE, kv=kv_pb2.KeyValue(key=KEY, mod_revision=11))
    assert codec.watch_input(3, Notice(revision=11, events=(deleted,))) == m.Watched(
        3, [m.KeyRev(KEY, 0, 11, deleted=True)], 11
    )
    key, end, only_deletes = codec.watch_range(m.OpenWatch(4, PREFIX, prefix=True))
    assert (key, end, only_deletes) == (PREFIX, b"/conch/v1/sema/x/10", True)
    assert codec.watch_range(m.OpenWatch(4, KEY, prefix=False)) == (KEY, b"", False)


@pytest.mark.parametrize(
    ("error", "failure"),
    [
        (Unavailable("no answer"), m.Failure.UNREACHABLE),
        (Compacted("compacted", 3), m.Failure.COMPACTED),
        (LeaseNotFound("lease not found", "NOT_FOUND"), m.Failure.LEASE_NOT_FOUND),
        (NO_SPACE, m.Failure.NO_SPACE),
        (PermissionDenied("permission denied", "PERMISSION_DENIED"), m.Failure.OTHER),
    ],
)
def test_one_table_names_every_failure(error: EtcdError, failure: m.Failure) -> None:
    assert codec.failure(error) == failure
    assert codec.failed(5, error) == m.Failed(5, failure, str(error), error)


def test_a_head_read_kept_answers_only_a_standing_in_the_window_not_holding() -> None:
    """At max 1 the window is 3 keys: ours second or third is in it and waits; ours first
    would hold, fourth would wait behind it: those read afresh (None). A fresh read (its
    second Range given) answers them all."""
    keys = [m.KeyRev(PREFIX + bytes([97 + i]), 5 + i, 5 + i) for i in range(5)]
    head = (30, keys)

    def standing(
        i: int, more: list[rpc_pb2.RangeResponse] | None = None
    ) -> m.StandingAnswer | None:
        return codec.head_answer(m.ReadStanding(1, keys[i].key, 5 + i), head, 1, more)

    answer = standing(2)
    assert answer == m.StandingAnswer(1, 30, keys[:3], [keys[2], keys[1]])
    assert standing(1) == m.StandingAnswer(1, 30, keys[:2], [keys[1], keys[0]])
    assert standing(0) is None and standing(3) is None
    assert standing(0, []) == m.StandingAnswer(1, 30, keys[:1], [keys[0]])
    assert standing(3, []) == m.StandingAnswer(1, 30, keys[:3], [keys[3], keys[2]])
    gone = m.ReadStanding(1, PREFIX + b"z", 40)  # ours not among the first keys read
    pair = rpc_pb2.RangeResponse(kvs=[kv_pb2.KeyValue(key=PREFIX + b"y", create_revision=39)])
    answer = codec.head_answer(gone, head, 1, [pair])
    assert answer is not None and answer.window == keys[:3]
    assert [k.key for k in answer.mine_and_prev] == [PREFIX + b"y"]
