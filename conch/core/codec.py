"""The codec: each action of the Waiter as the etcd request(s) that carry it out (a ``Call``,
which a face sends with its own client), and each etcd response, error or watch notice as
the input the Waiter is fed. Pure functions on protobuf messages and ``conch.core.messages``
records: both faces and the simulator execute what it builds and feed back what it decodes,
so they cannot read etcd differently. Ranges read at one revision follow the read plan
(``read_plan``, ``ReadTogether``); docs/design.md ("The codec") has the releases and why.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.core import messages
from conch.core.waiter import window_size
from conch.errors import Compacted, EtcdError, LeaseNotFound, Unavailable
from conch.etcd import kv  # its request builders only: pure functions of protobuf


@dataclass(frozen=True)
class Call:
    """One unary etcd RPC of the KV service to send: ``method`` ("Txn", "Range") and its
    protobuf ``request``."""

    method: str
    request: rpc_pb2.TxnRequest | rpc_pb2.RangeRequest
    timeout: float | None = None  # seconds, not cut short by an interrupt; None: the client's


def _txn(
    compare: Iterable[rpc_pb2.Compare],
    success: Iterable[rpc_pb2.RequestOp],
    failure: Iterable[rpc_pb2.RequestOp] = (),
) -> Call:
    return Call("Txn", rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure))


Head = tuple[int, list[messages.KeyRev]]  # a read of the queue's first keys: revision, keys


def key_rev(item: kv_pb2.KeyValue, deleted: bool = False) -> messages.KeyRev:
    return messages.KeyRev(item.key, int(item.create_revision), int(item.mod_revision), deleted)


def _standing_ranges(prefix: bytes, max: int, upto: int = 0, head: int = 0) -> Reads:
    """The window (``head``: that many first keys of the whole queue) and the last two keys,
    none created after revision ``upto`` (0: any)."""
    keys = {"keys_only": True, "sort_target": kv.CREATE}
    first = (head or window_size(max), kv.ASCEND, 0 if head else upto)
    return Reads(
        kv.prefix_request(prefix, limit=n, sort_order=order, max_create_revision=top, **keys)
        for n, order, top in (first, (2, kv.DESCEND, upto))
    )


def enqueue_call(
    action: messages.SendEnqueue, prefix: bytes, max: int, value: bytes, read: bool = True
) -> Call:
    """``action`` as one KV.Txn: if our key's create_revision is 0, put it (``value``, bound
    to the lease) and, with ``read``, read our standing in the same Txn (the Ranges of
    ``standing_reads``, and a count_only Range under ``prefix``: the keys ahead, and ours);
    else Range our key. Not read-only, so no release's read-only Txn bug applies. The reads
    cost etcd's apply loop every key of the prefix: ``conch.core.line`` says when to skip
    them. Decode with ``enqueue_answer``."""
    count = kv.prefix_request(prefix, count_only=True)
    ranges = [*_standing_ranges(prefix, max), count] if read else []
    return _txn(
        [kv.create_revision_is(action.key, 0)],
        [kv.op_put(action.key, value, action.lease_id), *map(kv.op_range, ranges)],
        [kv.op_range(rpc_pb2.RangeRequest(key=action.key))],
    )


def enqueue_answer(
    action: messages.SendEnqueue, response: rpc_pb2.TxnResponse, sent: bytes
) -> messages.EnqueueAnswer:
    """The TxnResponse to ``enqueue_call`` (``sent``: the value put) as EnqueueAnswer."""
    revision = int(response.header.revision)
    if response.succeeded and len(response.responses) == 1:  # put without the reads
        return messages.EnqueueAnswer(action.id, revision, True, sent)
    if response.succeeded:
        window, mine_and_prev, counted = (r.response_range for r in response.responses[1:])
        read = standing_answer(action, Together(revision, [window, mine_and_prev]))
        standing = replace(read, keys=int(counted.count))
        return messages.EnqueueAnswer(action.id, revision, True, sent, standing=standing)
    found = response.responses[0].response_range.kvs
    if not found:
        return messages.EnqueueAnswer(action.id, revision, False)
    ours = found[0].lease == action.lease_id
    value = found[0].value if ours else b""
    return messages.EnqueueAnswer(
        action.id, revision, False, value, existing=key_rev(found[0]), existing_ours=ours
    )


class Reads(list[rpc_pb2.RangeRequest]):
    """RangeRequests to read at one revision (``ReadTogether``). ``enough(answers)``, where
    set, says after each pinned Range whether the ones still to read are told by those read."""

    enough: Callable[[Sequence[rpc_pb2.RangeResponse]], bool] | None = None


def standing_reads(action: messages.ReadStanding, prefix: bytes, max: int, head: int = 0) -> Reads:
    """The two Ranges of the standing read, keys only: the window (``window_size(max)`` keys
    ascending by create_revision, none created after ours; ``head``: the queue's first
    ``head`` keys) and our key with the one just ahead (2 keys descending). Read them with
    ``ReadTogether``: a first Range that holds our key is enough (ours is its last key)."""
    reads = _standing_ranges(prefix, max, action.revision, head)
    reads.enough = lambda answers: any(k.key == action.key for k in answers[0].kvs)
    return reads


def standing_answer(action: messages.Tagged, read: Together) -> messages.StandingAnswer:
    """What ``standing_reads`` (or ``enqueue_call``'s Txn) read together, as StandingAnswer
    to ``action`` (a ReadStanding, or the SendEnqueue)."""
    window = list(read.responses[0].kvs)
    # The window alone (``Reads.enough``): its last two keys are ours and the one ahead.
    mine_and_prev = read.responses[1].kvs if len(read.responses) > 1 else window[-2:][::-1]
    return messages.StandingAnswer(
        action.id, read.revision, [key_rev(k) for k in window], [key_rev(k) for k in mine_and_prev]
    )


def head_answer(
    action: messages.ReadStanding, head: Head, max: int, more: Sequence[Any] | None = None
) -> messages.StandingAnswer | None:
    """``action``'s standing from ``head`` (a revision and the first keys of the queue then:
    ``standing_reads(head=...)``'s first Range) and ``more`` (its second, if read: ours and
    the one ahead). Without ``more`` (an earlier read, less keys deleted since), None unless
    ours is in the window and not holding: its gap check then counts what left since."""
    upto = [k for k in head[1] if k.create_revision <= action.revision]
    ours = [k for k in upto[-1:] if (k.key, k.create_revision) == (action.key, action.revision)]
    if more is None and not (ours and max < len(upto) <= window_size(max)):
        return None
    pair = upto[-2:][::-1] if ours else [key_rev(k) for r in more or () for k in r.kvs]
    return messages.StandingAnswer(action.id, head[0], upto[: window_size(max)], pair)


def keys_reads(action: messages.ReadKeys) -> list[rpc_pb2.RangeRequest]:
    """One Range per key of ``action``, in its order, to read with ``ReadTogether``."""
    return [rpc_pb2.RangeRequest(key=key) for key in action.keys]


def keys_answer(action: messages.ReadKeys, read: Together) -> messages.KeysAnswer:
    """What ``keys_reads`` read together, as KeysAnswer (None for a key absent)."""
    kvs = [key_rev(r.kvs[0]) if r.kvs else None for r in read.responses]
    return messages.KeysAnswer(action.id, kvs, read.revision)


class ReadPlan(enum.Enum):
    """How Ranges are read at one revision."""

    TXN = "txn"  # one read-only KV.Txn of them all: one round trip
    PINNED_RANGES = "pinned-ranges"  # the first Range, then the others at its revision


# etcd releases whose read-only Txn can take the server down (etcd issues 14110, 14891).
TXN_PANIC_FROM = (3, 5, 0)
TXN_PANIC_FIXED = (3, 5, 7)

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def read_plan(server_version: str | None) -> ReadPlan:
    """How to read Ranges together from the server of ``server_version`` (Maintenance.Status's
    ``version``, "3.5.1"; None: not known): pinned Ranges on a release whose read-only Txn
    can crash it, or one not known, else one read-only Txn."""
    match = _VERSION.match(server_version or "")
    version = tuple(int(part) for part in match.groups()) if match else TXN_PANIC_FROM
    return ReadPlan.PINNED_RANGES if TXN_PANIC_FROM <= version < TXN_PANIC_FIXED else ReadPlan.TXN


@dataclass(frozen=True)
class Together:
    """Ranges seen at one ``revision``, their RangeResponses in the order asked."""

    revision: int
    responses: Sequence[rpc_pb2.RangeResponse]


class ReadTogether:
    """Read ``reads`` (RangeRequests) at one revision, by ``plan``; a face drives it as::

        read = ReadTogether(reads, plan)
        while (call := read.next_call()) is not None:
            try:
                read.answer(send(call))
            except EtcdError as exc:
                read.refused(exc)  # raises exc again unless the read goes on another way
        return read.result

    A read-only Txn refused under the space alarm (NOSPACE: etcd before 3.4.20 and 3.5.7) is
    read again as pinned Ranges at once. Any other error ends the read (``refused`` raises
    it: Compacted, a pinned Range's revision compacted, the machine reads again)."""

    def __init__(self, reads: Sequence[rpc_pb2.RangeRequest], plan: ReadPlan) -> None:
        assert reads
        self.reads = list(reads)
        self.enough = reads.enough if isinstance(reads, Reads) else None
        self.plan = plan
        self._answers: list[rpc_pb2.RangeResponse] = []
        self._revision = 0

    def next_call(self) -> Call | None:
        """The next request to send, or None when ``result`` is ready."""
        if self._done():
            return None
        if self.plan == ReadPlan.TXN:
            return _txn([], [kv.op_range(r) for r in self.reads])
        read = rpc_pb2.RangeRequest()
        read.CopyFrom(self.reads[len(self._answers)])
        read.revision = self._revision  # the first's (the first: 0, now; no read sets its own)
        return Call("Range", read)

    def answer(self, response: rpc_pb2.TxnResponse | rpc_pb2.RangeResponse) -> None:
        """The response to the last ``next_call``."""
        if not self._answers:  # the first read fixes the revision the others are pinned to
            self._revision = int(response.header.revision)
        if isinstance(response, rpc_pb2.TxnResponse):
            self._answers = [r.response_range for r in response.responses]
        else:
            self._answers.append(response)

    def refused(self, error: EtcdError) -> None:
        """The last ``next_call`` failed with ``error``: go on another way, or raise it."""
        if self.plan != ReadPlan.TXN or failure(error) != messages.Failure.NO_SPACE:
            raise error
        self.plan = ReadPlan.PINNED_RANGES

    def _done(self) -> bool:
        if len(self._answers) == len(self.reads):
            return True
        return bool(self._answers) and self.enough is not None and self.enough(self._answers)

    @property
    def result(self) -> Together:
        """The responses read: all of ``reads``, or the first ones, where they were enough."""
        assert self._done()
        return Together(self._revision, self._answers)


def touch_call(key: bytes, revision: int, value: bytes, lease_id: int) -> Call:
    """The touch as one KV.Txn: re-put ``key`` (``value``, on ``lease_id``) if its
    create_revision is still ``revision``; ``succeeded`` false when the key is gone."""
    return _txn([kv.create_revision_is(key, revision)], [kv.op_put(key, value, lease_id)])


def touch_answer(action: messages.Touch, response: rpc_pb2.TxnResponse) -> messages.TouchAnswer:
    """The TxnResponse to ``touch_call`` as TouchAnswer."""
    return messages.TouchAnswer(action.id, bool(response.succeeded))


def withdraw_call(action: messages.Withdraw) -> Call:
    """A Withdraw without ``revoke`` as one KV.Txn: delete our key if its create_revision is
    ``action.revision``, or, when that is 0 (our enqueue's outcome unknown), if it is on
    ``action.lease_id``."""
    compare = kv.create_revision_is(action.key, action.revision)
    if not action.revision:
        compare = rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL,
            target=rpc_pb2.Compare.LEASE,
            key=action.key,
            lease=action.lease_id,
        )
    return _txn([compare], [kv.op_delete(action.key)])


def count_ahead(prefix: bytes, revision: int) -> Generator[Call, rpc_pb2.RangeResponse, int]:
    """The ``queued`` log line's count of the keys ahead of ours (created at ``revision``),
    as steps: yields each KV.Range, is sent its response (or thrown its error). The count
    under ``prefix`` just before ours (count_only at ``revision - 1``), one number however
    long the queue; that revision compacted, the keys created before ours that are still
    there, keys only (etcd's count ignores the max_create_revision filter)."""
    try:
        counted = kv.prefix_request(prefix, count_only=True, revision=revision - 1)
        return int((yield Call("Range", counted)).count)
    except Compacted:
        found = kv.prefix_request(prefix, keys_only=True, max_create_revision=revision - 1)
        return len((yield Call("Range", found)).kvs)


def watch_range(action: messages.OpenWatch) -> tuple[bytes, bytes, bool]:
    """What ``action`` watches: (key, range_end, only_deletes): every key under the prefix,
    deletions only, or the one key, every change."""
    if action.prefix:
        return action.key, kv.prefix_end(action.key), True
    return action.key, b"", False


class Notice(Protocol):
    """A watch notice as the etcd layer hands it over (``conch.etcd.watch.WatchNotice``)."""

    @property
    def error(self) -> Exception | None: ...
    @property
    def created(self) -> bool: ...
    @property
    def revision(self) -> int: ...
    @property
    def events(self) -> Sequence[kv_pb2.Event]: ...


def watch_input(watch_id: int, notice: Notice) -> messages.Watched:
    """A notice of watch ``watch_id`` as the machine's input: ended (compacted, or given
    up), created, or its events."""
    if notice.error is not None:
        return messages.Watched(watch_id, ended=True, detail=str(notice.error))
    if notice.created:
        return messages.Watched(watch_id, revision=notice.revision, created=True)
    events = [key_rev(e.kv, e.type == kv_pb2.Event.DELETE) for e in notice.events]
    return messages.Watched(watch_id, events, notice.revision)


def failure(error: EtcdError) -> messages.Failure:
    """The recipe's name for how a request failed with ``error``: the one table from what
    etcd said (the etcd layer's exception, which names the gRPC status:
    conch.etcd.client.map_rpc_error) to what the recipe does about it."""
    if isinstance(error, Compacted):  # a read pinned to a revision compaction just passed
        return messages.Failure.COMPACTED
    if isinstance(error, Unavailable):
        return messages.Failure.UNREACHABLE
    if isinstance(error, LeaseNotFound):
        return messages.Failure.LEASE_NOT_FOUND
    # etcd's space alarm: RESOURCE_EXHAUSTED "etcdserver: mvcc: database space exceeded".
    if error.code == "RESOURCE_EXHAUSTED" or "database space exceeded" in str(error):
        return messages.Failure.NO_SPACE
    return messages.Failure.OTHER


def failed(action_id: int, error: EtcdError) -> messages.Failed:
    """Request ``action_id`` failed with ``error``: the machine's input."""
    return messages.Failed(action_id, failure(error), str(error), error)
