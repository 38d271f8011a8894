"""A deterministic model of etcd v3's semantics, as conch's recipe relies on them.

Pure Python, no I/O, no threads, no wall clock: requests and responses are the etcd API's own
protobuf messages (``conchpb``), so one operation sequence runs against this model and a
real etcd unchanged (``tests/core/test_model.py`` does, so the model cannot drift from
etcd unnoticed). The simulator's scheduler (``tests/sim/schedule.py``) decides when a
request is applied, when its response arrives or is lost, when a watch notice is
delivered, and when the model's clock moves.

What is modelled, and the etcd document each rule comes from (etcd v3.5 docs unless said):

* **One revision counter** for the whole key space, starting at 1 in an empty store; every
  change (a Put, a DeleteRange that deletes something, a Txn that writes, a lease's revoke
  or expiry that deletes keys) raises it by exactly one, and all changes of one request
  share that revision. Reads do not raise it. (learning/api.md, "Revisions"; "Response
  header": the header's revision is the store's revision when the response was made.)
* **Keys** carry create_revision (the revision of the put that created the key), mod_revision
  (of its last put), version (1 at creation, +1 per put, reset when deleted) and lease
  (learning/api.md, "Key-Value pair"). A put with lease L moves the key onto L (a put
  with lease 0 takes it off any lease); a put with a lease that is not granted fails the
  whole request with "requested lease not found" (learning/api.md, "Put").
* **KV.Range** over a key or ``[key, range_end)`` (range_end "\\0" is every key >= key),
  filtered by min/max create/mod revision, sorted by sort_target/sort_order (ascending by
  default when the target is not KEY), then cut to ``limit`` with ``more`` set; ``count``
  counts the keys in the range *before* the revision filters, as etcd 3.5's apply does;
  keys_only drops values, count_only drops kvs (api-reference "RangeRequest"). With a
  sort_target but no sort_order (and no revision filter), etcd takes ``limit`` + 1 keys in
  key order first and sorts only those (found by the comparison test; etcd's v3_server.go).
* **KV.Txn**: every compare (create_revision, mod_revision, version, lease, value; EQUAL,
  NOT_EQUAL, GREATER, LESS) on the key as it is; a key that does not exist compares as
  zeros, and any compare on its value fails (learning/api.md, "Transaction"). Then the
  success or the failure ops, in order, each read seeing the writes before it in the
  same Txn; one revision for all its writes.
* **Leases**: LeaseGrant with TTL (raised to the server's minimum TTL), LeaseKeepAlive
  (restarts the countdown, answers TTL 0 for a lease that is gone), LeaseRevoke and expiry
  on the model's clock, which delete every key on the lease in one revision (learning/api.md,
  "Lease API": "all keys attached to the lease will be expired and deleted"; "Each expired
  key generates a delete event in the event history").
* **Watches** on a key or range, from a start revision (0: the revision after the current
  one), with the NOPUT / NODELETE filters; the first response is ``created`` with the
  current revision in its header; events come in revision order, never split inside a
  revision, none lost or repeated (learning/api.md, "Watch streams"; learning/api_guarantees.md,
  "Watch APIs": ordered, reliable, atomic). A DELETE event's kv has only the key and the
  deletion's revision as mod_revision (mvcc's tombstone).
* **Compaction** at revision C (C at most the current revision, above the last compaction):
  a Range at a revision below C fails with "required revision has been compacted"; a watch
  that starts below C, or that has not yet been sent the events below C, is cancelled with
  ``compact_revision`` C (api-reference "WatchResponse": "compact_revision is set to the
  minimum index if a watcher tries to watch at a compacted index ... or the watcher cannot
  catch up with the progress of the key-value store"). Compaction does not change the
  revision. (learning/api.md, "Compact".)
* **The space alarm** (op-guide/maintenance.md, "Space quota": "the cluster goes into a
  limited-operation maintenance mode which only accepts key reads and deletes"), as a
  member whose backend has grown to its ``--quota-backend-bytes`` has it: with ``nospace``
  set, a Put, a LeaseGrant and a Txn with a put in either branch (even the one not taken)
  fail with "mvcc: database space exceeded" and change nothing; a Range, a DeleteRange, a
  revoke, a keepalive, a watch and a compaction go through. A Txn without a put depends on
  the release (``version``; found by the comparison test, which fills a real
  backend): etcd's gRPC layer weighs each Put, Txn and LeaseGrant against the quota first
  (v3rpc/quota.go: the backend's size plus the request's cost, 0 for a Txn without a put,
  must stay under the quota), so at the quota it refuses a Txn that only reads or only
  deletes too, until 3.4.20 and 3.5.7 let requests that cost nothing through (etcd PRs
  14254 and 14884, "Allow non mutating requests pass through quotaKVServer when NOSPACE").
  etcd 3.5.1 refuses them, 3.4.23 serves them.
* **Reads at a revision**: a Range with ``revision`` R answers the keys as they were at R
  (count, filters and sort as for a current read), with the current revision in its
  header; R below the compaction fails "required revision has been compacted", R above
  the current one "required revision is a future revision" (learning/api.md, "Range").
* **Unreachable** (``reachable`` False): every request fails with UNAVAILABLE and changes
  nothing; lease countdowns go on (etcd does not stop the clock for a client it cannot
  hear, learning/api.md "Lease API"). A watch notice that was sent is lost only by a broken
  watch, which the scheduler decides (``break_watch``).
* **A member restart** (``stop`` then ``start``): while the member is down nothing is
  answered and no lease expires (no lessor runs); once it is back, its keys, leases and
  revision are as they were, and every lease's countdown starts again from its TTL (etcd's
  lessor, Promote, on becoming leader: "refreshes the expiries of all leases"; real etcd
  adds an election timeout on top, which the model leaves out), so a lease outlives an
  outage longer than its TTL. ``promote`` alone is a new leader elected.
* **A lost answer**: a write applied whose answer never reaches the client is applied once
  and only once; sending it again meets what it did (a create-if-absent finds its key).

Not modelled: several members (one linearizable store stands for the cluster), auth,
request size limits, watch fragmenting and progress notices.

``tests/core/test_model.py`` runs each rule above, as the operation sequences of
``tests/sim/scenarios.py``, against this model and a real etcd (3.5.1, and 3.4 with
``CONCH_TEST_ETCD=/usr/bin/etcd``) and requires the same answers.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

PUT = kv_pb2.Event.PUT
DELETE = kv_pb2.Event.DELETE
NOPUT = rpc_pb2.WatchCreateRequest.NOPUT
NODELETE = rpc_pb2.WatchCreateRequest.NODELETE

# etcd's default minimum lease TTL: 3/2 of the election timeout (1 s by default), rounded
# up to whole seconds (etcdserver's minTTL). A grant below it gets it instead.
MIN_TTL = 2
JUNK = b"/junk"  # where the conformance scenarios write until the backend is full


def refuses_reads_at_quota(version: str) -> bool:
    """Whether etcd ``version`` ("3.5.1") refuses a Txn without a put once its backend is
    at the quota: before 3.4.20 in 3.4, before 3.5.7 in 3.5 (none of 3.6 does)."""
    release = tuple(int(part) for part in version.split(".")[:3])
    return release < (3, 4, 20) or (3, 5) <= release < (3, 5, 7)


class ModelError(Exception):
    """An error etcd would answer with: ``code`` is the gRPC status name etcd uses, the
    message etcd's own text."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def lease_not_found() -> ModelError:
    return ModelError("NOT_FOUND", "etcdserver: requested lease not found")


def no_space() -> ModelError:
    return ModelError("RESOURCE_EXHAUSTED", "etcdserver: mvcc: database space exceeded")


def compacted() -> ModelError:
    return ModelError("OUT_OF_RANGE", "etcdserver: mvcc: required revision has been compacted")


def future_revision() -> ModelError:
    return ModelError("OUT_OF_RANGE", "etcdserver: mvcc: required revision is a future revision")


def unavailable() -> ModelError:
    return ModelError("UNAVAILABLE", "etcd unreachable")


@dataclass
class Lease:
    """A granted lease: ``ttl`` in seconds as granted, ``expires`` on the model's clock."""

    id: int
    ttl: int
    expires: float
    keys: set[bytes] = field(default_factory=set)


@dataclass
class ModelWatch:
    """One watcher. ``cursor`` is the first revision not yet taken out of the store's
    history for it (what etcd's watchable store calls minRev); ``outbox`` the responses
    made and not yet delivered."""

    id: int
    key: bytes
    range_end: bytes
    filters: frozenset[int]
    cursor: int
    outbox: list[rpc_pb2.WatchResponse] = field(default_factory=list)
    cancelled: bool = False

    def covers(self, key: bytes) -> bool:
        return in_range(key, self.key, self.range_end)


def in_range(key: bytes, start: bytes, end: bytes) -> bool:
    """Whether ``key`` is in etcd's range (start, end): one key when end is empty, every key
    >= start when end is "\\0", else [start, end)."""
    if not end:
        return key == start
    if end == b"\0":
        return key >= start
    return start <= key < end


class SimEtcd:
    """The model: ``revision``, ``compact_revision``, the keys, the leases, the watchers and
    a clock (``now``, seconds, moved only by ``advance``). Methods are etcd's RPCs, taking
    and returning the API's protobuf messages; an error etcd would answer raises
    ModelError. ``reachable`` and ``nospace`` are the faults a request can meet."""

    def __init__(self, lease_ids: Iterable[int] | None = None, version: str = "3.5.1") -> None:
        """``version``: the etcd release modelled, where releases differ (the space alarm,
        ``refuses_reads_at_quota``), and what Maintenance.Status answers."""
        self.version = version
        self.quota_refuses_reads = refuses_reads_at_quota(version)
        self.revision = 1
        self.compact_revision = 0
        self.kvs: dict[bytes, kv_pb2.KeyValue] = {}
        self.leases: dict[int, Lease] = {}
        self.history: list[tuple[int, list[kv_pb2.Event]]] = []  # (revision, its events)
        # Each key's versions: (revision, the key as of it, None once deleted), oldest first.
        self.versions: dict[bytes, list[tuple[int, kv_pb2.KeyValue | None]]] = {}
        self.watches: dict[int, ModelWatch] = {}
        self.deleted_at: dict[bytes, int] = {}  # each key's last deletion (for the checks)
        self.now = 0.0
        self.reachable = True
        self.nospace = False
        self.down = False  # the member is stopped: nothing answered, no lease expires
        self._next_lease = iter(lease_ids) if lease_ids is not None else None
        self._lease_counter = 0x7E57_0000
        self._watch_counter = 0

    # -- the clock -------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock on; leases whose countdown ran out expire, each in a revision of
        its own, in the order they ran out (then by ID); none while the member is down."""
        self.now += seconds
        if self.down:
            return
        due = sorted((le.expires, le.id) for le in self.leases.values() if le.expires <= self.now)
        for _, lease_id in due:
            self._revoke(lease_id)

    def expire(self, lease_id: int, ttl: int) -> None:
        """Let the lease run out (the clock moves on by its TTL); as ``RealEtcd.expire``."""
        del lease_id
        self.advance(ttl)

    def let_run(self, lease_id: int, seconds: int) -> None:
        """Let the lease's countdown run ``seconds`` on (no keepalive); as ``RealEtcd``'s."""
        del lease_id
        self.advance(seconds)

    def restart(self, down_for: float) -> None:
        """The member killed, down ``down_for`` seconds, started again with its data."""
        self.stop()
        self.advance(down_for)
        self.start()

    def fill_space(self) -> None:
        """Junk written outside the semaphores until the backend is at its quota."""
        self.put(rpc_pb2.PutRequest(key=JUNK, value=b"x"))
        self.nospace = True

    def clear_space(self) -> None:
        """The operator's way out: the junk deleted, compacted away, the alarm disarmed."""
        self.delete_range(rpc_pb2.DeleteRangeRequest(key=JUNK))
        self.compact(self.revision)
        self.nospace = False

    def answer_lost(self, method: str, request: Any) -> None:
        """Send ``request`` to the RPC ``method`` (``txn``, ``lease_revoke``, ...) and lose
        its answer: applied, and the client told DEADLINE_EXCEEDED."""
        getattr(self, method)(request)
        raise ModelError("DEADLINE_EXCEEDED", "answer lost")

    def promote(self) -> None:
        """A member becomes leader (etcd restarted, or a new leader elected): every lease's
        countdown starts again from now, as etcd's lessor does on promotion (Promote
        "refreshes the expiries of all leases", server/lease/lessor.go), so leases outlive
        an outage shorter than their TTL."""
        for lease in self.leases.values():
            lease.expires = self.now + lease.ttl

    def stop(self) -> None:
        """The member stops (killed): unreachable, and its lessor with it."""
        self.down, self.reachable = True, False

    def start(self) -> None:
        """The member is back, with its data, and leads again (``promote``)."""
        self.down, self.reachable = False, True
        self.promote()

    def set_nospace(self, on: bool) -> None:
        """Raise or clear the space alarm."""
        self.nospace = on

    # -- KV ----------------------------------------------------------------------------------

    def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        self._check_reachable()
        return self._range(request)

    def put(self, request: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        self._check_reachable()
        if self.nospace:
            raise no_space()
        changes: list[kv_pb2.Event] = []
        self._check_leases([request])
        prev = self._put(request, self.revision + 1, changes)
        self._commit(changes)
        response = rpc_pb2.PutResponse(header=self._header())
        if request.prev_kv and prev is not None:
            response.prev_kv.CopyFrom(prev)
        return response

    def delete_range(self, request: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        self._check_reachable()
        changes: list[kv_pb2.Event] = []
        deleted = self._delete(request, self.revision + 1, changes)
        self._commit(changes)
        response = rpc_pb2.DeleteRangeResponse(header=self._header(), deleted=len(deleted))
        if request.prev_kv:
            response.prev_kvs.extend(deleted)
        return response

    def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        self._check_reachable()
        if self.nospace and (self.quota_refuses_reads or _txn_puts(request)):
            raise no_space()  # whichever branch the compares would take
        changes: list[kv_pb2.Event] = []
        response = self._txn(request, changes)
        self._commit(changes)
        _set_headers(response, self._header())
        return response

    def compact(self, revision: int) -> rpc_pb2.CompactionResponse:
        self._check_reachable()
        return self.auto_compact(revision)

    def auto_compact(self, revision: int) -> rpc_pb2.CompactionResponse:
        """Compaction as etcd's own auto-compaction does it: whoever can reach etcd."""
        if revision <= self.compact_revision:
            raise compacted()
        if revision > self.revision:
            raise future_revision()
        # A watcher that was sent everything it wants is synced (etcd's synced group) and
        # unaffected; one that still owes events below the compaction can never get them.
        behind = [
            watch
            for watch in self.watches.values()
            if not watch.cancelled and any(rev < revision for rev, _ in self._events_for(watch))
        ]
        self.compact_revision = revision
        self.history = [(rev, events) for rev, events in self.history if rev >= revision]
        for key, versions in list(self.versions.items()):
            kept = [i for i, (rev, _) in enumerate(versions) if rev <= revision]
            if kept:
                del versions[: kept[-1]]  # the version in force at the compaction stays
            if versions == [versions[0]] and versions[0][1] is None:
                del self.versions[key]
        for watch in behind:
            self._cancel_compacted(watch)
        return rpc_pb2.CompactionResponse(header=self._header())

    # -- Maintenance -------------------------------------------------------------------------

    def status(self) -> rpc_pb2.StatusResponse:
        """Maintenance.Status: the release, and the member's view of the store."""
        self._check_reachable()
        return rpc_pb2.StatusResponse(header=self._header(), version=self.version, leader=1)

    # -- Lease -------------------------------------------------------------------------------

    def lease_grant(self, request: rpc_pb2.LeaseGrantRequest) -> rpc_pb2.LeaseGrantResponse:
        self._check_reachable()
        if self.nospace:
            raise no_space()
        lease_id = request.ID or self._new_lease_id()
        if lease_id in self.leases:
            raise ModelError("FAILED_PRECONDITION", "etcdserver: lease already exists")
        ttl = max(int(request.TTL), MIN_TTL)
        self.leases[lease_id] = Lease(lease_id, ttl, self.now + ttl)
        return rpc_pb2.LeaseGrantResponse(header=self._header(), ID=lease_id, TTL=ttl)

    def lease_revoke(self, request: rpc_pb2.LeaseRevokeRequest) -> rpc_pb2.LeaseRevokeResponse:
        self._check_reachable()
        if request.ID not in self.leases:
            raise lease_not_found()
        self._revoke(request.ID)
        return rpc_pb2.LeaseRevokeResponse(header=self._header())

    def lease_keepalive(
        self, request: rpc_pb2.LeaseKeepAliveRequest
    ) -> rpc_pb2.LeaseKeepAliveResponse:
        """One LeaseKeepAlive message and its answer (TTL 0: the lease is gone)."""
        self._check_reachable()
        lease = self.leases.get(request.ID)
        if lease is None:
            return rpc_pb2.LeaseKeepAliveResponse(header=self._header(), ID=request.ID, TTL=0)
        lease.expires = self.now + lease.ttl
        return rpc_pb2.LeaseKeepAliveResponse(header=self._header(), ID=lease.id, TTL=lease.ttl)

    def lease_time_to_live(
        self, request: rpc_pb2.LeaseTimeToLiveRequest
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        self._check_reachable()
        lease = self.leases.get(request.ID)
        if lease is None:
            return rpc_pb2.LeaseTimeToLiveResponse(header=self._header(), ID=request.ID, TTL=-1)
        left = max(0, math.ceil(lease.expires - self.now))
        response = rpc_pb2.LeaseTimeToLiveResponse(
            header=self._header(), ID=lease.id, TTL=left, grantedTTL=lease.ttl
        )
        if request.keys:
            response.keys.extend(sorted(lease.keys))
        return response

    # -- Watch -------------------------------------------------------------------------------

    def watch_create(self, request: rpc_pb2.WatchCreateRequest) -> int:
        """Create a watcher (its ``created`` response queued first) and return its id."""
        self._check_reachable()
        self._watch_counter += 1
        start = request.start_revision or self.revision + 1
        watch = ModelWatch(
            self._watch_counter,
            request.key,
            request.range_end,
            frozenset(request.filters),
            start,
        )
        self.watches[watch.id] = watch
        watch.outbox.append(
            rpc_pb2.WatchResponse(header=self._header(), watch_id=watch.id, created=True)
        )
        if start < self.compact_revision:
            self._cancel_compacted(watch)
        return watch.id

    def watch_cancel(self, watch_id: int) -> None:
        """Drop the watcher: nothing more is delivered for it."""
        watch = self.watches.pop(watch_id, None)
        if watch is not None:
            watch.cancelled = True
            watch.outbox.clear()

    def watch_pending(self, watch_id: int) -> bool:
        """Whether a response is ready for the watcher (queued, or events in history)."""
        watch = self.watches.get(watch_id)
        if watch is None:
            return False
        return bool(watch.outbox) or (not watch.cancelled and self._events_for(watch, 1) != [])

    def watch_next(self, watch_id: int, revisions: int = 1) -> rpc_pb2.WatchResponse | None:
        """The next response of the watcher, in order: a queued one (created, cancelled),
        else the events of up to ``revisions`` revisions from its cursor (etcd sends a
        revision's events together, and may put several revisions in one response).
        None when nothing is due."""
        watch = self.watches.get(watch_id)
        if watch is None:
            return None
        if watch.outbox:
            response = watch.outbox.pop(0)
            if response.canceled:
                self.watches.pop(watch_id, None)
            return response
        if watch.cancelled:
            return None
        batches = self._events_for(watch, revisions)
        if not batches:
            return None
        watch.cursor = batches[-1][0] + 1
        events = [event for _, evs in batches for event in evs]
        return rpc_pb2.WatchResponse(header=self._header(), watch_id=watch.id, events=events)

    def break_watch(self, watch_id: int) -> None:
        """The watch's stream broke: the watcher is gone, what it had not delivered is lost
        (a client resumes by creating a new watch from the revision it needs)."""
        self.watch_cancel(watch_id)

    # -- what the checks read ----------------------------------------------------------------

    def delete_by_hand(self, key: bytes) -> None:
        """DeleteRange of ``key`` by someone else (etcdctl del), whatever the faults."""
        changes: list[kv_pb2.Event] = []
        if key in self.kvs:
            self._delete_key(key, self.revision + 1, changes)
        self._commit(changes)

    def revoke_by_hand(self, lease_id: int) -> None:
        """LeaseRevoke by someone else (etcdctl lease revoke), whatever the faults."""
        if lease_id in self.leases:
            self._revoke(lease_id)

    def under(self, prefix: bytes) -> list[kv_pb2.KeyValue]:
        """The keys under ``prefix`` by create_revision (then key), no request, no fault."""
        kvs = [kv for key, kv in self.kvs.items() if key.startswith(prefix)]
        return sorted(kvs, key=lambda kv: (kv.create_revision, kv.key))

    # -- inside ------------------------------------------------------------------------------

    def _check_reachable(self) -> None:
        if not self.reachable:
            raise unavailable()

    def _header(self) -> rpc_pb2.ResponseHeader:
        return rpc_pb2.ResponseHeader(cluster_id=1, member_id=1, revision=self.revision)

    def _new_lease_id(self) -> int:
        if self._next_lease is not None:
            return next(self._next_lease)
        self._lease_counter += 1
        return self._lease_counter

    def _commit(self, changes: list[kv_pb2.Event]) -> None:
        """One revision for the changes of one request, if there are any."""
        if not changes:
            return
        self.revision += 1
        self.history.append((self.revision, changes))

    def _range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        if request.revision:
            if request.revision < self.compact_revision:
                raise compacted()
            if request.revision > self.revision:
                raise future_revision()
        store = self.kvs
        if request.revision and request.revision != self.revision:
            store = self._store_at(request.revision)
        found = [kv for key, kv in store.items() if in_range(key, request.key, request.range_end)]
        count = len(found)
        found = [kv for kv in found if _passes_filters(kv, request)]
        found.sort(key=lambda kv: kv.key)
        more = bool(request.limit) and len(found) > request.limit
        if (
            request.limit
            and request.sort_order == rpc_pb2.RangeRequest.NONE
            and not _filtered(request)
        ):
            # etcd fetches ``limit`` + 1 keys in key order (the extra one for ``more``) and
            # only then sorts them: with a sort_target but no sort_order, the limit does not
            # pick the first by that target.
            found = found[: request.limit + 1]
        order = request.sort_order
        if request.sort_target != rpc_pb2.RangeRequest.KEY and order == rpc_pb2.RangeRequest.NONE:
            order = rpc_pb2.RangeRequest.ASCEND
        if order != rpc_pb2.RangeRequest.NONE:
            found.sort(
                key=lambda kv: _sort_key(kv, request.sort_target),
                reverse=order == rpc_pb2.RangeRequest.DESCEND,
            )
        if request.limit:
            found = found[: request.limit]
        response = rpc_pb2.RangeResponse(header=self._header(), count=count, more=more)
        if request.count_only:
            return response
        for kv in found:
            out = response.kvs.add()
            out.CopyFrom(kv)
            if request.keys_only:
                out.ClearField("value")
        return response

    def _store_at(self, revision: int) -> dict[bytes, kv_pb2.KeyValue]:
        """The keys as they were at ``revision`` (at or after the compaction)."""
        store = {}
        for key, versions in self.versions.items():
            found = None
            for rev, kv in versions:
                if rev > revision:
                    break
                found = kv
            if found is not None:
                store[key] = found
        return store

    def _check_leases(self, puts: Sequence[rpc_pb2.PutRequest]) -> None:
        for put in puts:
            if put.ignore_value or put.ignore_lease:
                raise NotImplementedError("ignore_value and ignore_lease are not modelled")
            if put.lease and put.lease not in self.leases:
                raise lease_not_found()

    def _put(
        self, request: rpc_pb2.PutRequest, revision: int, changes: list[kv_pb2.Event]
    ) -> kv_pb2.KeyValue | None:
        prev = self.kvs.get(request.key)
        kv = kv_pb2.KeyValue(
            key=request.key,
            value=request.value,
            create_revision=prev.create_revision if prev is not None else revision,
            mod_revision=revision,
            version=prev.version + 1 if prev is not None else 1,
            lease=request.lease,
        )
        if prev is not None and prev.lease and prev.lease in self.leases:
            self.leases[prev.lease].keys.discard(request.key)
        if request.lease:
            self.leases[request.lease].keys.add(request.key)
        self.kvs[request.key] = kv
        self.versions.setdefault(request.key, []).append((revision, kv))
        changes.append(kv_pb2.Event(type=PUT, kv=kv))
        return prev

    def _delete(
        self, request: rpc_pb2.DeleteRangeRequest, revision: int, changes: list[kv_pb2.Event]
    ) -> list[kv_pb2.KeyValue]:
        doomed = sorted(k for k in self.kvs if in_range(k, request.key, request.range_end))
        return [self._delete_key(key, revision, changes) for key in doomed]

    def _delete_key(
        self, key: bytes, revision: int, changes: list[kv_pb2.Event]
    ) -> kv_pb2.KeyValue:
        prev = self.kvs.pop(key)
        if prev.lease and prev.lease in self.leases:
            self.leases[prev.lease].keys.discard(key)
        tombstone = kv_pb2.KeyValue(key=key, mod_revision=revision)
        self.deleted_at[key] = revision
        self.versions[key].append((revision, None))
        changes.append(kv_pb2.Event(type=DELETE, kv=tombstone))
        return prev

    def _revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        changes: list[kv_pb2.Event] = []
        for key in sorted(lease.keys):
            if key in self.kvs:
                self._delete_key(key, self.revision + 1, changes)
        self._commit(changes)

    def _txn(self, request: rpc_pb2.TxnRequest, changes: list[kv_pb2.Event]) -> rpc_pb2.TxnResponse:
        succeeded = all(self._compare(c) for c in request.compare)
        ops = request.success if succeeded else request.failure
        self._check_leases(_txn_put_requests(request, succeeded))
        revision = self.revision + 1
        response = rpc_pb2.TxnResponse(succeeded=succeeded)
        for op in ops:
            out = response.responses.add()
            kind = op.WhichOneof("request")
            if kind == "request_range":
                out.response_range.CopyFrom(self._range(op.request_range))
            elif kind == "request_put":
                prev = self._put(op.request_put, revision, changes)
                out.response_put.SetInParent()
                if op.request_put.prev_kv and prev is not None:
                    out.response_put.prev_kv.CopyFrom(prev)
            elif kind == "request_delete_range":
                deleted = self._delete(op.request_delete_range, revision, changes)
                out.response_delete_range.deleted = len(deleted)
                if op.request_delete_range.prev_kv:
                    out.response_delete_range.prev_kvs.extend(deleted)
            elif kind == "request_txn":
                out.response_txn.CopyFrom(self._txn(op.request_txn, changes))
        return response

    def _compare(self, compare: rpc_pb2.Compare) -> bool:
        if compare.range_end:
            raise NotImplementedError("compares over a range are not modelled")
        kv = self.kvs.get(compare.key)
        target = compare.target
        if target == rpc_pb2.Compare.VALUE:
            if kv is None:
                return False  # etcd: a compare on the value of a missing key fails
            ours, theirs = kv.value, compare.value
            return _holds(compare.result, ours, theirs)
        current = kv or kv_pb2.KeyValue()
        if target == rpc_pb2.Compare.CREATE:
            return _holds(compare.result, current.create_revision, compare.create_revision)
        if target == rpc_pb2.Compare.MOD:
            return _holds(compare.result, current.mod_revision, compare.mod_revision)
        if target == rpc_pb2.Compare.VERSION:
            return _holds(compare.result, current.version, compare.version)
        if target == rpc_pb2.Compare.LEASE:
            return _holds(compare.result, current.lease, compare.lease)
        raise NotImplementedError(f"compare target {target}")

    def _events_for(
        self, watch: ModelWatch, limit: int | None = None
    ) -> list[tuple[int, list[kv_pb2.Event]]]:
        """The revisions from the watcher's cursor on that have events it wants (the first
        ``limit`` of them)."""
        out = []
        start = bisect.bisect_left(self.history, watch.cursor, key=lambda entry: entry[0])
        for revision, events in itertools.islice(self.history, start, None):
            wanted = [e for e in events if watch.covers(e.kv.key) and _wanted(e, watch.filters)]
            if wanted:
                out.append((revision, wanted))
                if len(out) == limit:
                    break
        return out

    def _cancel_compacted(self, watch: ModelWatch) -> None:
        watch.cancelled = True
        watch.outbox.append(
            rpc_pb2.WatchResponse(
                header=self._header(),
                watch_id=watch.id,
                canceled=True,
                compact_revision=self.compact_revision,
                cancel_reason="mvcc: required revision has been compacted",
            )
        )


def _holds(result: int, ours: int | bytes, theirs: int | bytes) -> bool:
    if result == rpc_pb2.Compare.EQUAL:
        return ours == theirs
    if result == rpc_pb2.Compare.NOT_EQUAL:
        return ours != theirs
    if result == rpc_pb2.Compare.GREATER:
        return ours > theirs  # type: ignore[operator]
    if result == rpc_pb2.Compare.LESS:
        return ours < theirs  # type: ignore[operator]
    raise NotImplementedError(f"compare result {result}")


def _passes_filters(kv: kv_pb2.KeyValue, request: rpc_pb2.RangeRequest) -> bool:
    if request.min_mod_revision and kv.mod_revision < request.min_mod_revision:
        return False
    if request.max_mod_revision and kv.mod_revision > request.max_mod_revision:
        return False
    if request.min_create_revision and kv.create_revision < request.min_create_revision:
        return False
    return not (request.max_create_revision and kv.create_revision > request.max_create_revision)


def _filtered(request: rpc_pb2.RangeRequest) -> bool:
    return bool(
        request.min_mod_revision
        or request.max_mod_revision
        or request.min_create_revision
        or request.max_create_revision
    )


def _sort_key(kv: kv_pb2.KeyValue, target: int) -> int | bytes:
    if target == rpc_pb2.RangeRequest.KEY:
        return bytes(kv.key)
    if target == rpc_pb2.RangeRequest.VERSION:
        return int(kv.version)
    if target == rpc_pb2.RangeRequest.CREATE:
        return int(kv.create_revision)
    if target == rpc_pb2.RangeRequest.MOD:
        return int(kv.mod_revision)
    return bytes(kv.value)


def _wanted(event: kv_pb2.Event, filters: frozenset[int]) -> bool:
    if event.type == PUT:
        return NOPUT not in filters
    return NODELETE not in filters


def _txn_puts(request: rpc_pb2.TxnRequest) -> bool:
    """Whether a put appears anywhere in the Txn, either branch, nested Txns included
    (etcd's isTxnPut: what the space alarm refuses)."""
    for op in [*request.success, *request.failure]:
        kind = op.WhichOneof("request")
        if kind == "request_put" or (kind == "request_txn" and _txn_puts(op.request_txn)):
            return True
    return False


def _txn_put_requests(request: rpc_pb2.TxnRequest, succeeded: bool) -> list[rpc_pb2.PutRequest]:
    """The puts of the branch taken (not nested Txns': they check their own)."""
    ops = request.success if succeeded else request.failure
    return [op.request_put for op in ops if op.WhichOneof("request") == "request_put"]


def _set_headers(response: rpc_pb2.TxnResponse, header: rpc_pb2.ResponseHeader) -> None:
    """Every response inside a Txn carries the Txn's header, as etcd fills them."""
    response.header.CopyFrom(header)
    for out in response.responses:
        kind = out.WhichOneof("response")
        if kind == "response_txn":
            _set_headers(out.response_txn, header)
        elif kind is not None:
            getattr(out, kind).header.CopyFrom(header)
