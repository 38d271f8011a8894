"""Operation sequences run against the model and a real etcd alike; each returns what it
observed, normalised (revisions, ranks, outcomes), so ``tests/core/test_model.py`` can require
the two to agree. Every sequence starts on an empty etcd at revision 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.core import codec, messages
from tests.sim.model import ModelError

P = b"/conch/v1/sema/sim/2/"
END = P[:-1] + b"0"  # prefix_end of P


class Etcd(Protocol):
    def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse: ...
    def put(self, request: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse: ...
    def delete_range(self, request: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse: ...
    def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse: ...
    def compact(self, revision: int) -> rpc_pb2.CompactionResponse: ...
    def lease_grant(self, request: rpc_pb2.LeaseGrantRequest) -> rpc_pb2.LeaseGrantResponse: ...
    def lease_revoke(self, request: rpc_pb2.LeaseRevokeRequest) -> rpc_pb2.LeaseRevokeResponse: ...
    def lease_keepalive(
        self, request: rpc_pb2.LeaseKeepAliveRequest
    ) -> rpc_pb2.LeaseKeepAliveResponse: ...
    def lease_time_to_live(
        self, request: rpc_pb2.LeaseTimeToLiveRequest
    ) -> rpc_pb2.LeaseTimeToLiveResponse: ...
    def expire(self, lease_id: int, ttl: int) -> None: ...
    def watch_create(self, request: rpc_pb2.WatchCreateRequest) -> int: ...
    def watch_next(self, watch_id: int, revisions: int = 1) -> rpc_pb2.WatchResponse | None: ...
    def watch_cancel(self, watch_id: int) -> None: ...
    def let_run(self, lease_id: int, seconds: int) -> None: ...
    def restart(self, down_for: float) -> None: ...
    def fill_space(self) -> None: ...
    def clear_space(self) -> None: ...
    def answer_lost(self, method: str, request: Any) -> None: ...


Observed = list[Any]


def kv_(kv: kv_pb2.KeyValue) -> tuple[bytes, int, int, int, int, bytes]:
    return (kv.key, kv.create_revision, kv.mod_revision, kv.version, kv.lease, kv.value)


def range_(response: rpc_pb2.RangeResponse) -> tuple[Any, ...]:
    return (
        response.header.revision,
        [kv_(kv) for kv in response.kvs],
        response.count,
        response.more,
    )


def txn_(response: rpc_pb2.TxnResponse) -> tuple[Any, ...]:
    out: list[Any] = []
    for op in response.responses:
        kind = op.WhichOneof("response")
        if kind == "response_range":
            out.append(("range", [kv_(kv) for kv in op.response_range.kvs]))
            out.append(("count", op.response_range.count, op.response_range.more))
        elif kind == "response_put":
            out.append(("put", kv_(op.response_put.prev_kv)))
        elif kind == "response_delete_range":
            out.append(("deleted", op.response_delete_range.deleted))
    return (response.header.revision, response.succeeded, out)


def events_(response: rpc_pb2.WatchResponse | None) -> tuple[Any, ...]:
    if response is None:
        return ("nothing",)
    return (
        response.created,
        response.canceled,
        response.compact_revision,
        [(e.type, kv_(e.kv)) for e in response.events],
    )


def error_(call: Callable[[], Any]) -> tuple[str, str] | Any:
    """The call's outcome, or the error etcd answered (code and message)."""
    try:
        return call()
    except ModelError as error:
        return ("error", error.code, error.message)


def put(key: bytes, value: bytes = b"v", lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def create_is(key: bytes, revision: int) -> rpc_pb2.Compare:
    return rpc_pb2.Compare(
        result=rpc_pb2.Compare.EQUAL,
        target=rpc_pb2.Compare.CREATE,
        key=key,
        create_revision=revision,
    )


def queue_range(**fields: Any) -> rpc_pb2.RangeRequest:
    return rpc_pb2.RangeRequest(
        key=P, range_end=END, sort_target=rpc_pb2.RangeRequest.CREATE, keys_only=True, **fields
    )


def enqueue(etcd: Etcd, key: bytes, lease: int, max: int) -> rpc_pb2.TxnResponse:
    """conch's enqueue (``codec.enqueue_call``): create-if-absent on the lease, and its
    standing and the count under the prefix read in the same Txn."""
    call = codec.enqueue_call(messages.SendEnqueue(0, key, lease), P, max, b"me")
    assert isinstance(call.request, rpc_pb2.TxnRequest)
    return etcd.txn(call.request)


def queue_and_ranks(etcd: Etcd) -> Observed:
    """Revisions, create_revision order, limit/more/count, max_create_revision, descending
    order, a create-if-absent that finds its key, a touch, a compare on lease and value."""
    seen: Observed = []
    leases = [0x51A0 + i for i in range(4)]
    for lease in leases:
        seen.append(etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=lease, TTL=60)).TTL)
    keys = [P + b"%x" % lease for lease in leases]
    for key, lease in zip(reversed(keys), reversed(leases), strict=True):
        seen.append(txn_(enqueue(etcd, key, lease, 2)))
    seen.append(txn_(enqueue(etcd, keys[0], leases[0], 2)))  # exists: the failure branch
    seen.append(range_(etcd.range(queue_range())))
    seen.append(range_(etcd.range(queue_range(limit=2))))
    mine = etcd.range(rpc_pb2.RangeRequest(key=keys[1])).kvs[0]
    seen.append(
        range_(
            etcd.range(
                queue_range(
                    limit=2,
                    max_create_revision=mine.create_revision,
                    sort_order=rpc_pb2.RangeRequest.DESCEND,
                )
            )
        )
    )
    touch = rpc_pb2.TxnRequest(
        compare=[create_is(keys[1], mine.create_revision)], success=[put(keys[1], b"me", leases[1])]
    )
    seen.append(txn_(etcd.txn(touch)))
    seen.append(range_(etcd.range(rpc_pb2.RangeRequest(key=keys[1]))))
    on_lease = rpc_pb2.Compare(
        result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.LEASE, key=keys[2], lease=leases[2]
    )
    wrong_value = rpc_pb2.Compare(
        result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.VALUE, key=keys[2], value=b"no"
    )
    missing_value = rpc_pb2.Compare(
        result=rpc_pb2.Compare.NOT_EQUAL, target=rpc_pb2.Compare.VALUE, key=P + b"none", value=b"x"
    )
    delete = rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=keys[2]))
    seen.append(
        txn_(etcd.txn(rpc_pb2.TxnRequest(compare=[on_lease, wrong_value], success=[delete])))
    )
    seen.append(txn_(etcd.txn(rpc_pb2.TxnRequest(compare=[missing_value], success=[delete]))))
    seen.append(txn_(etcd.txn(rpc_pb2.TxnRequest(compare=[on_lease], success=[delete]))))
    # a delete that deletes nothing changes nothing, not even the revision
    seen.append(txn_(etcd.txn(rpc_pb2.TxnRequest(compare=[on_lease], failure=[delete]))))
    seen.append(range_(etcd.range(queue_range())))
    return seen


def leases_go_with_their_keys(etcd: Etcd) -> Observed:
    """Revoke and expiry delete every key of the lease in one revision; a put on a lease
    that is gone fails; keepalive of a gone lease answers TTL 0; a watch sees the deletions
    of one revision in one response; a short TTL is raised to the minimum."""
    seen: Observed = []
    seen.append(etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=0xA1, TTL=60)).TTL)
    seen.append(etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=0xA2, TTL=1)).TTL)
    for key in (b"a", b"b"):
        etcd.put(rpc_pb2.PutRequest(key=P + key, value=b"1", lease=0xA1))
    etcd.put(rpc_pb2.PutRequest(key=P + b"c", value=b"1", lease=0xA2))
    etcd.put(rpc_pb2.PutRequest(key=P + b"d", value=b"1", lease=0xA2))
    etcd.put(rpc_pb2.PutRequest(key=P + b"d", value=b"2", lease=0))  # off the lease
    watch = etcd.watch_create(
        rpc_pb2.WatchCreateRequest(key=P, range_end=END, filters=[rpc_pb2.WatchCreateRequest.NOPUT])
    )
    created = etcd.watch_next(watch)
    seen.append((created is not None and created.created, created and created.header.revision))
    seen.append(etcd.lease_revoke(rpc_pb2.LeaseRevokeRequest(ID=0xA1)).header.revision)
    seen.append(events_(etcd.watch_next(watch)))
    seen.append(etcd.lease_keepalive(rpc_pb2.LeaseKeepAliveRequest(ID=0xA1)).TTL)
    seen.append(error_(lambda: etcd.put(rpc_pb2.PutRequest(key=P + b"e", lease=0xA1)).header))
    seen.append(
        error_(lambda: txn_(etcd.txn(rpc_pb2.TxnRequest(success=[put(P + b"e", lease=0xA1)]))))
    )
    seen.append(error_(lambda: etcd.lease_revoke(rpc_pb2.LeaseRevokeRequest(ID=0xA1)).header))
    etcd.expire(0xA2, 2)
    seen.append(events_(etcd.watch_next(watch)))
    seen.append(range_(etcd.range(queue_range())))
    etcd.watch_cancel(watch)
    return seen


def watches_and_compaction(etcd: Etcd) -> Observed:
    """A watch from a past revision replays in order; one from before the compaction is
    cancelled with the compact revision; reads below it fail; compaction keeps the
    revision; only-deletes filters puts."""
    seen: Observed = []
    for i in range(5):
        seen.append(
            etcd.put(rpc_pb2.PutRequest(key=P + b"k%d" % (i % 2), value=b"%d" % i)).header.revision
        )
    etcd.delete_range(rpc_pb2.DeleteRangeRequest(key=P + b"k0"))
    replay = etcd.watch_create(rpc_pb2.WatchCreateRequest(key=P, range_end=END, start_revision=3))
    seen.append(events_(etcd.watch_next(replay)))
    events: list[Any] = []
    while len(events) < 5:
        response = etcd.watch_next(replay, revisions=2)
        assert response is not None, "the replay stopped short"
        events.extend((e.type, kv_(e.kv)) for e in response.events)
    seen.append(events)
    etcd.watch_cancel(replay)
    seen.append(etcd.compact(4).header.revision)
    seen.append(error_(lambda: etcd.compact(3).header.revision))
    seen.append(error_(lambda: etcd.compact(99).header.revision))
    seen.append(error_(lambda: range_(etcd.range(rpc_pb2.RangeRequest(key=P, revision=2)))))
    seen.append(error_(lambda: range_(etcd.range(rpc_pb2.RangeRequest(key=P, revision=99)))))
    old = etcd.watch_create(rpc_pb2.WatchCreateRequest(key=P, range_end=END, start_revision=2))
    seen.append(events_(etcd.watch_next(old)))
    seen.append(events_(etcd.watch_next(old)))
    etcd.watch_cancel(old)
    deletes = etcd.watch_create(
        rpc_pb2.WatchCreateRequest(
            key=P, range_end=END, start_revision=4, filters=[rpc_pb2.WatchCreateRequest.NOPUT]
        )
    )
    seen.append(events_(etcd.watch_next(deletes)))
    seen.append(events_(etcd.watch_next(deletes)))
    etcd.watch_cancel(deletes)
    return seen


def space_alarm(etcd: Etcd) -> Observed:
    """With the backend at its quota: puts, lease grants and every Txn (a touch whose put
    is in the branch not taken, a withdraw that only deletes, a read-only Txn) are refused
    and change nothing; a Range (at the current revision, or pinned to an earlier one), a
    DeleteRange, a keepalive and a revoke go through. Once the junk is gone and the alarm
    disarmed, a put goes through again. Revisions are counted from the one the junk left."""
    seen: Observed = []
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=0xB1, TTL=60))
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=0xB2, TTL=60))
    etcd.put(rpc_pb2.PutRequest(key=P + b"a", value=b"1", lease=0xB1))
    etcd.put(rpc_pb2.PutRequest(key=P + b"b", value=b"1", lease=0xB2))
    etcd.put(rpc_pb2.PutRequest(key=P + b"c", value=b"1"))
    etcd.fill_space()
    base = int(etcd.range(rpc_pb2.RangeRequest(key=P)).header.revision)

    def at(revision: int) -> int:
        return int(revision) - base

    seen.append(error_(lambda: at(etcd.put(rpc_pb2.PutRequest(key=P + b"d")).header.revision)))
    seen.append(error_(lambda: etcd.lease_grant(rpc_pb2.LeaseGrantRequest(TTL=60)).TTL))
    touch_not_taken = rpc_pb2.TxnRequest(
        compare=[create_is(P + b"a", 0)], success=[], failure=[put(P + b"a")]
    )
    seen.append(error_(lambda: txn_(etcd.txn(touch_not_taken))[1:]))
    withdraw = rpc_pb2.TxnRequest(
        compare=[create_is(P + b"c", 4)],
        success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=P + b"c"))],
    )
    seen.append(error_(lambda: txn_(etcd.txn(withdraw))[1:]))
    read_only = rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_range=queue_range())])
    seen.append(error_(lambda: txn_(etcd.txn(read_only))[1:]))
    read = etcd.range(queue_range())
    seen.append((at(read.header.revision), *range_(read)[1:]))
    seen.append(etcd.lease_keepalive(rpc_pb2.LeaseKeepAliveRequest(ID=0xB1)).TTL)
    deleted = etcd.delete_range(rpc_pb2.DeleteRangeRequest(key=P + b"c"))
    seen.append((at(deleted.header.revision), deleted.deleted))
    seen.append(at(etcd.lease_revoke(rpc_pb2.LeaseRevokeRequest(ID=0xB1)).header.revision))
    # the standing read's fallback: Ranges pinned to the revision of the first
    for pinned in (base, base + 1):
        read = etcd.range(queue_range(revision=pinned))
        seen.append((at(read.header.revision), *range_(read)[1:]))
    read = etcd.range(queue_range())
    seen.append((at(read.header.revision), *range_(read)[1:]))
    etcd.clear_space()
    seen.append(at(etcd.put(rpc_pb2.PutRequest(key=P + b"d")).header.revision))
    answer = etcd.txn(read_only)
    seen.append(
        (answer.succeeded, [bytes(kv.key) for kv in answer.responses[0].response_range.kvs])
    )
    return seen


def reads_at_a_revision(etcd: Etcd) -> Observed:
    """A Range pinned to a past revision sees the keys as they were then (deleted ones,
    earlier values, keys since created left out), its count too, under the current
    revision's header; at the compaction's revision it still answers, below it not."""
    seen: Observed = []
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=0xC1, TTL=60))
    for i in range(3):
        etcd.put(rpc_pb2.PutRequest(key=P + b"%d" % i, value=b"a", lease=0xC1 if i else 0))
    etcd.put(rpc_pb2.PutRequest(key=P + b"0", value=b"b"))  # 5
    etcd.delete_range(rpc_pb2.DeleteRangeRequest(key=P + b"1"))  # 6
    etcd.lease_revoke(rpc_pb2.LeaseRevokeRequest(ID=0xC1))  # 7: the key 2 goes
    etcd.put(rpc_pb2.PutRequest(key=P + b"3", value=b"a"))  # 8
    for revision in range(1, 9):
        seen.append(
            range_(etcd.range(rpc_pb2.RangeRequest(key=P, range_end=END, revision=revision)))
        )
    seen.append(range_(etcd.range(queue_range(revision=4, limit=2))))
    seen.append(
        range_(etcd.range(queue_range(revision=5, sort_order=rpc_pb2.RangeRequest.DESCEND)))
    )
    etcd.compact(6)
    seen.append(error_(lambda: range_(etcd.range(queue_range(revision=5)))))
    seen.append(range_(etcd.range(queue_range(revision=6))))
    seen.append(range_(etcd.range(queue_range(revision=7))))
    return seen


def lost_answers(etcd: Etcd) -> Observed:
    """A write whose answer is lost was applied, once: the enqueue sent again finds our
    key on our lease (the failure branch, the revision unmoved); a touch sent again still
    compares equal on our create_revision; a revoke whose answer was lost took the key."""
    seen: Observed = []
    lease = 0xD1
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=lease, TTL=60))
    key = P + b"%x" % lease
    request = rpc_pb2.TxnRequest(
        compare=[create_is(key, 0)],
        success=[put(key, b"me", lease), rpc_pb2.RequestOp(request_range=queue_range(limit=2))],
        failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
    )
    seen.append(error_(lambda: etcd.answer_lost("txn", request)))
    seen.append(txn_(etcd.txn(request)))
    touch = rpc_pb2.TxnRequest(compare=[create_is(key, 2)], success=[put(key, b"me", lease)])
    seen.append(error_(lambda: etcd.answer_lost("txn", touch)))
    seen.append(txn_(etcd.txn(touch)))
    seen.append(range_(etcd.range(rpc_pb2.RangeRequest(key=key))))
    revoke = rpc_pb2.LeaseRevokeRequest(ID=lease)
    seen.append(error_(lambda: etcd.answer_lost("lease_revoke", revoke)))
    seen.append(error_(lambda: etcd.lease_revoke(revoke).header.revision))
    seen.append(range_(etcd.range(queue_range())))
    return seen


def member_restart(etcd: Etcd) -> Observed:
    """A member killed and started again on its data keeps its keys, leases and revision;
    every lease's countdown starts again, so one whose TTL is shorter than the outage
    survives it, and one that had run down is back at its TTL; a watch from the revision
    before the outage sees what came after."""
    seen: Observed = []
    long, short = 0xE1, 0xE2
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=long, TTL=30))
    etcd.put(rpc_pb2.PutRequest(key=P + b"long", value=b"1", lease=long))
    etcd.let_run(long, 3)
    before = etcd.lease_time_to_live(rpc_pb2.LeaseTimeToLiveRequest(ID=long)).TTL
    etcd.lease_grant(rpc_pb2.LeaseGrantRequest(ID=short, TTL=5))
    etcd.put(rpc_pb2.PutRequest(key=P + b"short", value=b"1", lease=short))
    revision = etcd.range(rpc_pb2.RangeRequest(key=P)).header.revision
    etcd.restart(down_for=6.0)  # longer than the short lease's TTL
    seen.append(etcd.range(rpc_pb2.RangeRequest(key=P)).header.revision - revision)
    after = etcd.lease_time_to_live(rpc_pb2.LeaseTimeToLiveRequest(ID=long)).TTL
    seen.append(("countdown started again", after > before, after >= 27))
    seen.append(
        ("short lease", etcd.lease_time_to_live(rpc_pb2.LeaseTimeToLiveRequest(ID=short)).TTL > 0)
    )
    seen.append(range_(etcd.range(queue_range()))[1:])
    etcd.put(rpc_pb2.PutRequest(key=P + b"after", value=b"1"))
    watch = etcd.watch_create(
        rpc_pb2.WatchCreateRequest(key=P, range_end=END, start_revision=revision + 1)
    )
    seen.append(events_(etcd.watch_next(watch))[:2])
    seen.append(events_(etcd.watch_next(watch)))
    etcd.watch_cancel(watch)
    return seen


SCENARIOS: dict[str, Callable[[Etcd], Observed]] = {
    "queue_and_ranks": queue_and_ranks,
    "leases_go_with_their_keys": leases_go_with_their_keys,
    "watches_and_compaction": watches_and_compaction,
    "space_alarm": space_alarm,
    "reads_at_a_revision": reads_at_a_revision,
    "lost_answers": lost_answers,
    "member_restart": member_restart,
}
