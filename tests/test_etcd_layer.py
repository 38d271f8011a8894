"""The hand-written etcd layer against a real etcd: KV/Txn, leases, watches, failover."""

from __future__ import annotations

import queue
import time

import pytest
from conchpb.etcdserverpb import rpc_pb2

from conch.errors import Compacted, LeaseNotFound, Unavailable
from conch.etcd import Client, Endpoint, kv, lease
from conch.etcd.watch import DELETE, PUT, Watch, WatchNotice
from conch.session import Session
from tests.conftest import DEADLINE
from tests.etcd_server import EtcdCluster, free_port


def test_txn_create_if_absent_succeeds_once(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    ops = ([kv.create_revision_is(key, 0)], [kv.op_put(key, b"one")], [kv.op_get(key)])
    first = kv.txn(client, *ops)
    second = kv.txn(client, *ops)
    assert first.succeeded and not second.succeeded
    found = second.responses[0].response_range.kvs[0]
    assert found.value == b"one"
    assert found.create_revision == first.header.revision


def test_keys_bound_to_a_revoked_lease_vanish(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    granted = lease.grant(client, 30)
    kv.put(client, key, b"x", lease=granted.id)
    assert kv.get(client, key) is not None
    lease.revoke(client, granted.id)
    assert kv.get(client, key) is None
    assert lease.time_to_live(client, granted.id) == -1
    lease.revoke(client, granted.id)  # revoking twice is not an error


def test_keepalive_refreshes_and_reports_a_revoked_lease(client: Client) -> None:
    granted = lease.grant(client, 5)
    keepalive = lease.KeepAlive(client, granted.id)
    try:
        assert keepalive.refresh(time.monotonic() + 5) == granted.ttl
        lease.revoke(client, granted.id)
        with pytest.raises(LeaseNotFound):
            keepalive.refresh(time.monotonic() + 5)
    finally:
        keepalive.close()


def test_session_declares_loss_when_its_lease_is_revoked_from_outside(client: Client) -> None:
    session = Session(client, ttl=3)
    try:
        lease.revoke(client, session.lease_id)
        # Loss is noticed within one keepalive interval (TTL/3) plus the margin.
        assert session.lost.wait(timeout=DEADLINE)
        assert "revoked" in str(session.lost.reason)
    finally:
        session.close()


def test_session_close_revokes_the_lease(client: Client) -> None:
    session = Session(client, ttl=10)
    assert lease.time_to_live(client, session.lease_id) > 0
    assert session.close()
    assert lease.time_to_live(client, session.lease_id) == -1
    assert not session.lost.is_set()


def test_watch_from_a_past_revision_replays_events(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    first = kv.put(client, key, b"a").header.revision
    kv.delete(client, key)
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    watch = Watch(client, key, first, box.put)
    try:
        seen: list[int] = []
        while len(seen) < 2:
            notice = box.get(timeout=DEADLINE)
            assert notice.error is None
            seen.extend(e.type for e in notice.events)
        assert seen == [PUT, DELETE]
    finally:
        watch.cancel()


def test_watch_only_deletes_filters_puts(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    start = kv.put(client, key, b"a").header.revision
    kv.put(client, key, b"b")
    kv.delete(client, key)
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    watch = Watch(client, key, start, box.put, only_deletes=True)
    try:
        notice = box.get(timeout=DEADLINE)
        assert [e.type for e in notice.events] == [DELETE]
    finally:
        watch.cancel()


def test_watch_reports_a_compacted_start_revision(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    old = kv.put(client, key, b"a").header.revision
    newer = kv.put(client, key, b"b").header.revision
    client.call("kv", "Compact", rpc_pb2.CompactionRequest(revision=newer))
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    watch = Watch(client, key, old, box.put)
    try:
        notice = box.get(timeout=DEADLINE)
        assert isinstance(notice.error, Compacted)
        assert notice.error.compact_revision >= newer
    finally:
        watch.cancel()


def test_cancelled_watch_delivers_nothing_more(client: Client, name: str) -> None:
    key = f"/test/{name}".encode()
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    start = kv.put(client, key, b"a").header.revision + 1
    watch = Watch(client, key, start, box.put)
    watch.cancel()
    kv.put(client, key, b"b")
    with pytest.raises(queue.Empty):
        box.get(timeout=1.0)


def test_connect_to_a_dead_endpoint_fails_within_the_dial_timeout() -> None:
    began = time.monotonic()
    with pytest.raises(Unavailable, match="cannot reach etcd"):
        Client.connect([Endpoint.parse(f"127.0.0.1:{free_port()}")], dial_timeout=1.0)
    assert time.monotonic() - began < 5.0


def test_calls_fail_over_past_a_dead_endpoint(etcd: EtcdCluster, name: str) -> None:
    dead = Endpoint.parse(f"127.0.0.1:{free_port()}")
    live = Endpoint.parse(etcd.members[0].endpoint)
    with Client.connect([dead, live], dial_timeout=5.0) as client:
        key = f"/test/{name}".encode()
        kv.put(client, key, b"v")
        assert client.endpoint == live
        stored = kv.get(client, key)
        assert stored is not None and stored.value == b"v"
