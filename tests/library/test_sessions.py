"""Shared sessions, one Watch stream per client, threads per client, dropped holds."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable

import pytest
from conchpb.mvccpb.kv_pb2 import Event

import conch
from conch.etcd import Client, Endpoint, kv, lease
from conch.etcd.watch import Watch, WatchNotice
from tests.conftest import DEADLINE, etcd_watchers, poll, sema_keys
from tests.delayproxy import FaultProxy, lose_answer, watch_created
from tests.etcd_server import EtcdCluster


def _threads() -> set[threading.Thread]:
    """Every thread but the application's own (named "app" here): conch's, gRPC's."""
    return {t for t in threading.enumerate() if t.name != "app"}


# -- a shared session ------------------------------------------------------------------


def test_holds_of_two_semaphores_share_one_lease_and_release_their_own_keys_only(
    client: Client, name: str
) -> None:
    with conch.Session(client, ttl=5) as session:
        a = conch.Semaphore(client, name + "a", max=1).acquire(timeout=10, session=session)
        b = conch.Semaphore(client, name + "b", max=1).acquire(timeout=10, session=session)
        assert a.lease_id == b.lease_id == session.lease_id
        a.release()
        assert sema_keys(client, name + "a") == []
        assert len(sema_keys(client, name + "b")) == 1, "the release revoked the shared lease"
        assert lease.time_to_live(client, session.lease_id) > 0
        b.check()  # still certainly ours
        b.release()
        assert sema_keys(client, name + "b") == []
        assert not session.lost.is_set()
    assert lease.time_to_live(client, session.lease_id) == -1


def test_many_holds_of_one_semaphore_on_one_session_are_keys_of_its_one_lease(
    client: Client, name: str
) -> None:
    """A session holds any number of keys of one semaphore: three acquires at max 2 on one
    session queue three keys on its one lease, in order; a release deletes its own key only,
    and the waiter behind takes the slot."""
    sema = conch.Semaphore(client, name, max=2)
    with conch.Session(client, ttl=5) as session:
        first = sema.acquire(timeout=10, session=session)
        second = sema.acquire(timeout=10, session=session)
        third: queue.Queue[conch.Hold] = queue.Queue()
        waiter = threading.Thread(
            target=lambda: third.put(sema.acquire(timeout=30, session=session)), name="app"
        )
        waiter.start()
        poll(lambda: len(sema_keys(client, name)) == 3, what="the third key queued")
        queued = sema_keys(client, name)
        assert {k.lease for k in queued} == {session.lease_id}
        assert len({k.key for k in queued}) == 3
        assert third.empty(), "a third hold at max 2"
        first.release()
        last = third.get(timeout=DEADLINE)
        waiter.join(DEADLINE)
        assert first.revision < second.revision < last.revision
        assert [k.create_revision for k in sema_keys(client, name)] == [
            second.revision,
            last.revision,
        ]
        assert not second.lost.is_set() and not last.lost.is_set()
        second.release()
        last.release()
        assert sema_keys(client, name) == []
        assert lease.time_to_live(client, session.lease_id) > 0
    assert lease.time_to_live(client, session.lease_id) == -1


def test_a_second_spread_hold_of_one_semaphore_on_one_session_is_refused_and_leaves_nothing(
    client: Client, name: str
) -> None:
    """With --spread the key is the host's (one per node): a second spread acquire of one
    semaphore on one session would be that one key. It is refused; the first hold stands;
    once it is released the session may acquire that semaphore again."""
    sema = conch.Semaphore(client, name, max=2, spread=True)
    with conch.Session(client, ttl=5) as session:
        first = sema.acquire(timeout=10, session=session)
        with pytest.raises(conch.UsageError, match="one spread hold per semaphore per session"):
            sema.acquire(timeout=10, session=session)
        assert [kv_.create_revision for kv_ in sema_keys(client, name)] == [first.revision]
        assert not first.lost.is_set()
        first.release()
        again = sema.acquire(timeout=10, session=session)
        again.release()
    assert sema_keys(client, name) == []


def test_the_loss_of_a_shared_session_loses_every_hold_on_it(client: Client, name: str) -> None:
    with conch.Session(client, ttl=5) as session:
        holds = [
            conch.Semaphore(client, f"{name}{i}", max=1).acquire(timeout=10, session=session)
            for i in range(3)
        ]
        lease.revoke(client, session.lease_id)
        for hold in holds:
            assert hold.lost.wait(DEADLINE)
            with pytest.raises(conch.HoldLost):
                hold.check()
            hold.release()


def test_a_hold_left_on_a_shared_session_that_is_closed_is_lost(client: Client, name: str) -> None:
    session = conch.Session(client, ttl=5)
    hold = conch.Semaphore(client, name, max=1).acquire(timeout=10, session=session)
    session.close()
    with pytest.raises(conch.HoldLost):
        hold.check()
    assert hold.lost.wait(DEADLINE)  # the guard saw the key go with the lease
    hold.release()
    assert sema_keys(client, name) == []


def test_a_waiter_whose_shared_session_is_lost_raises_and_is_not_granted_a_new_lease(
    client: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A private session lost while queued is replaced (the waiter re-enters); a shared one
    belongs to the caller, and its holds must not move silently to another lease. Nor does
    it log a requeue it will not make (it did, when the revoke reached its watch before its
    keepalive)."""
    caplog.set_level(logging.INFO, logger="conch")
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    holder = sema.acquire(timeout=10)
    errors: list[BaseException] = []
    session = conch.Session(client, ttl=5)

    def wait() -> None:
        try:
            sema.acquire(timeout=DEADLINE, session=session).release()
        except conch.ConchError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        poll(lambda: len(sema_keys(client, name)) == 2, what="the waiter queued")
        lease.revoke(client, session.lease_id)
        waiter.join(DEADLINE)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], conch.SessionLost), errors
        assert [k.lease for k in sema_keys(client, name)] == [holder.lease_id]
        assert "event=requeue" not in caplog.text
    finally:
        holder.release()
        session.close()
    assert sema_keys(client, name) == []


def test_a_waiter_on_a_shared_session_that_gives_up_deletes_its_key_and_keeps_the_lease(
    client: Client, name: str
) -> None:
    sema = conch.Semaphore(client, name, max=1)
    with sema.acquire(timeout=10), conch.Session(client, ttl=5) as session:
        with pytest.raises(conch.NoSlot):
            sema.acquire(timeout=0.5, session=session)
        assert len(sema_keys(client, name)) == 1
        assert lease.time_to_live(client, session.lease_id) > 0
        with pytest.raises(conch.UsageError):  # the client must be the semaphore's
            conch.Semaphore(_other_client(client), name, max=1).acquire(session=session)
    assert sema_keys(client, name) == []


def test_a_shared_waiter_whose_enqueue_went_through_unanswered_leaves_no_key(
    proxies: Callable[[], FaultProxy], name: str
) -> None:
    """etcd applied our enqueue but the answer was lost (the call ran out of time), and time
    is up: the key must not stay on the shared lease, where it would queue as a ghost while
    the session lives."""
    proxy = proxies()
    with proxy.client(request_timeout=1.0) as client, conch.Session(client, ttl=5) as session:
        proxy.after("Txn", lose_answer, times=1)
        with pytest.raises(conch.NoSlot):
            conch.Semaphore(client, name, max=1).acquire(timeout=0, session=session)
        enqueued = [r for r in proxy.requests("Txn") if r.success]
        assert enqueued, "no enqueue went to etcd"
        assert sema_keys(client, name) == []


def _other_client(client: Client) -> Client:
    return Client(client.endpoints)


# -- one Watch stream per client ---------------------------------------------------------


def test_the_watches_of_one_client_share_one_stream_and_each_gets_its_own_events(
    client: Client, name: str
) -> None:
    before = sum(t.name == "conch-Watch" for t in threading.enumerate())
    boxes: list[queue.SimpleQueue[WatchNotice]] = [queue.SimpleQueue() for _ in range(20)]
    keys = [f"/test/{name}/{i}".encode() for i in range(20)]
    start = kv.put(client, b"/test/" + name.encode(), b"x").header.revision + 1
    watches = [Watch(client, k, start, box.put) for k, box in zip(keys, boxes, strict=True)]
    try:
        readers = sum(t.name == "conch-Watch" for t in threading.enumerate()) - before
        assert readers <= 1, f"{readers} stream readers for 20 watches"
        watches[3].cancel()
        for k in keys:
            kv.put(client, k, k)
        kv.delete(client, keys[5])
        for i, box in enumerate(boxes):
            if i == 3:
                continue
            want = [(Event.PUT, keys[i])] + ([(Event.DELETE, keys[i])] if i == 5 else [])
            assert _events(box, len(want)) == want
        with pytest.raises(queue.Empty):
            boxes[3].get(timeout=0.5)  # cancelled: nothing
    finally:
        for w in watches:
            w.cancel()


def _events(box: queue.SimpleQueue[WatchNotice], count: int) -> list[tuple[int, bytes]]:
    """The next ``count`` events delivered to ``box`` (etcd may batch them)."""
    seen: list[tuple[int, bytes]] = []
    while len(seen) < count:
        notice = box.get(timeout=DEADLINE)
        assert notice.error is None, notice.error
        seen.extend((e.type, e.kv.key) for e in notice.events)
    return seen


def test_the_shared_stream_follows_a_failover_of_calls_and_resumes_every_watch(
    cluster: EtcdCluster,
) -> None:
    """When calls move off an endpoint (Client.on_failover), the shared stream moves too,
    and every watch on it resumes after the last revision it delivered."""
    proxies = [FaultProxy(m.endpoint) for m in cluster.members[:2]]
    endpoints = [Endpoint.parse(p.endpoint) for p in proxies]
    try:
        with Client.connect(endpoints) as client:
            boxes: list[queue.SimpleQueue[WatchNotice]] = [queue.SimpleQueue() for _ in range(2)]
            keys = [b"/fo/a", b"/fo/b"]
            start = kv.put(client, b"/fo/a", b"0").header.revision
            watches = [Watch(client, k, start, b.put) for k, b in zip(keys, boxes, strict=True)]
            try:
                assert [e.kv.value for e in boxes[0].get(timeout=DEADLINE).events] == [b"0"]
                assert _watches_created(proxies[0]) == {k: start for k in keys}
                client.failover(endpoints[0])
                poll(lambda: len(_watches_created(proxies[1])) == 2, what="moved")
                # Each resumes after the last revision it delivered (/fo/b: none yet).
                assert _watches_created(proxies[1]) == {b"/fo/a": start + 1, b"/fo/b": start}
                kv.put(client, b"/fo/a", b"1")
                kv.put(client, b"/fo/b", b"1")
                assert [e.kv.value for e in boxes[0].get(timeout=DEADLINE).events] == [b"1"]
                assert [e.kv.value for e in boxes[1].get(timeout=DEADLINE).events] == [b"1"]
                with pytest.raises(queue.Empty):
                    boxes[0].get(timeout=0.5)  # nothing repeated
            finally:
                for w in watches:
                    w.cancel()
    finally:
        for p in proxies:
            p.close()


def _watches_created(proxy: FaultProxy) -> dict[bytes, int]:
    """The watches the client asked ``proxy``'s etcd for: key -> start revision."""
    return {
        r.create_request.key: r.create_request.start_revision
        for r in proxy.requests("Watch")
        if r.HasField("create_request")
    }


def test_a_single_endpoint_clients_failover_leaves_its_watch_stream_alone(
    proxies: Callable[[], FaultProxy], name: str
) -> None:
    """With one endpoint a failover moves nowhere (a unary call that timed out under load):
    the shared stream, and every watch on it, stays as it is."""
    proxy = proxies()
    box: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    with proxy.client() as client:
        watch = Watch(client, f"/test/{name}".encode(), 0, box.put, confirm=True)
        try:
            assert box.get(timeout=DEADLINE).created
            client.failover(client.endpoint)
            kv.put(client, f"/test/{name}".encode(), b"x")
            assert box.get(timeout=DEADLINE).events  # the stream still delivers
            assert len(proxy.requests("Watch")) == 1, "the watch was made again"
        finally:
            watch.cancel()


def test_a_lost_hold_kept_by_its_owner_leaves_no_watch_on_the_stream(
    own_etcd: EtcdCluster, name: str
) -> None:
    with own_etcd.client() as client:
        before = etcd_watchers(own_etcd)
        hold = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
        try:
            poll(lambda: etcd_watchers(own_etcd) > before, what="the guard's watch")
            kv.delete(client, hold.key)
            assert hold.lost.wait(DEADLINE)
            poll(
                lambda: etcd_watchers(own_etcd) == before,
                timeout=5.0,
                what="the guard's watch cancelled",
            )
        finally:
            hold.release()


# -- threads per client, not per hold --------------------------------------------------


def test_waiters_on_one_shared_session_cost_a_constant_number_of_threads(
    client: Client, name: str
) -> None:
    """20 waiters of 20 semaphores on one session: the threads conch adds do not grow with
    the number of waiters (each had its own watch stream, reader and probe threads)."""
    base = _threads()
    holders = [conch.Semaphore(client, f"{name}{i}", max=1, ttl=5) for i in range(20)]
    with conch.Session(client, ttl=5) as shared:
        holds = [s.acquire(timeout=10, session=shared) for s in holders]
        with conch.Session(client, ttl=5) as session:
            threads = []
            for sema in holders:
                t = threading.Thread(
                    target=_acquire_quietly, args=(sema, session), name="app", daemon=True
                )
                t.start()
                threads.append(t)
            poll(
                lambda: all(len(sema_keys(client, s.name)) == 2 for s in holders),
                what="every waiter queued",
            )
            added = _threads() - base
            # The client's keepalive thread and stream (reader, gRPC's request thread),
            # its stream opener, the watch stream (reader, request thread), the timer: 7,
            # and slack for threads of earlier tests' clients winding down; 20 waiters
            # made 60 more.
            assert len(added) <= 20, sorted(t.name for t in added)
            for hold in holds:
                hold.release()
            for t in threads:
                t.join(DEADLINE)


def _acquire_quietly(sema: conch.Semaphore, session: conch.Session) -> None:
    sema.acquire(timeout=DEADLINE, session=session).release()


# -- a dropped hold is released ------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_a_hold_dropped_in_a_live_process_is_released_with_a_warning(
    proxies: Callable[[], FaultProxy], client: Client, name: str, shared: bool
) -> None:
    """``del client, sema, hold; gc.collect()``: the key (and a private lease) must not
    outlive the hold by more than the TTL; a ResourceWarning says it was dropped."""
    ttl = 3
    proxy = proxies()
    own = proxy.client()
    session = conch.Session(own, ttl=ttl) if shared else None
    sema = conch.Semaphore(own, name, max=1, ttl=ttl)
    hold = sema.acquire(timeout=10, session=session)
    lease_id = hold.lease_id
    poll(lambda: watch_created(proxy.seen, prefix_only=False), what="the guard watching")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped = time.monotonic()
        del hold, sema
        if not shared:
            del own
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught), caught
    poll(lambda: sema_keys(client, name) == [], timeout=ttl + 2.0, what="the key gone")
    assert time.monotonic() - dropped < ttl + 2.0
    if shared:
        assert session is not None and not session.lost.is_set()
        assert lease.time_to_live(client, lease_id) > 0, "a dropped hold ended the session"
        session.close()
    else:
        assert lease.time_to_live(client, lease_id) == -1


def test_a_session_dropped_with_its_holds_is_revoked_with_a_warning(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    own = etcd.client()
    session = conch.Session(own, ttl=3)
    hold = conch.Semaphore(own, name, max=1).acquire(timeout=10, session=session)
    lease_id = session.lease_id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del hold, session, own
        gc.collect()
        poll(lambda: lease.time_to_live(client, lease_id) == -1, timeout=5.0, what="lease gone")
    assert sema_keys(client, name) == []
    dropped = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert any("hold" in m for m in dropped) and any("session" in m for m in dropped), dropped
