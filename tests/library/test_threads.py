"""What sessions, holds and waiters cost a client: threads and LeaseKeepAlive streams, and
the loss that sharing them must not delay. Against real etcd servers."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import conch
from conch.etcd import Client
from conch.session import Session
from conch.timer import timer_for
from tests.conftest import DEADLINE, poll, sema_keys
from tests.etcd_server import EtcdCluster, free_port

APP = "app"  # the name of the test's own threads, which are not conch's


def conch_threads() -> int:
    """OS threads of this process (gRPC's C threads included) but the test's own."""
    own = sum(t.name == APP for t in threading.enumerate())
    return len(os.listdir("/proc/self/task")) - own


@pytest.fixture
def before() -> int:
    """The process's threads before the test: what the tests run earlier in this process
    left (which ones those are depends on the worker the test lands on)."""
    return conch_threads()


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[tuple[EtcdCluster, str]]:
    """An etcd of its own, with its Prometheus metrics at the returned URL."""
    url = f"http://127.0.0.1:{free_port()}"
    cluster = EtcdCluster(tmp_path / "metered", extra=["--listen-metrics-urls", url])
    cluster.start()
    yield cluster, url
    cluster.stop()


def keepalive_streams_started(metrics_url: str) -> int:
    """etcd's count of LeaseKeepAlive streams opened on it so far."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(
        r'grpc_server_started_total\{[^}]*grpc_method="LeaseKeepAlive"[^}]*\} (\d+)', text
    )
    return int(found.group(1)) if found else 0


def kept_alive(session: Session, granted_until: float) -> bool:
    """Whether ``session`` has had a keepalive confirmed since it was granted."""
    return session.alive_until > granted_until


def open_sessions(client: Client, count: int, ttl: int) -> list[tuple[Session, float]]:
    sessions = []
    for _ in range(count):
        session = Session(client, ttl=ttl)
        sessions.append((session, session.alive_until))
    return sessions


def test_one_keepalive_stream_carries_every_lease_of_a_client(
    metered: tuple[EtcdCluster, str],
) -> None:
    """50 sessions on one client: every keepalive is confirmed, and etcd saw one
    LeaseKeepAlive stream opened, not one per lease."""
    cluster, metrics = metered
    with cluster.client() as client:
        before = keepalive_streams_started(metrics)
        sessions = open_sessions(client, 50, ttl=3)
        try:
            poll(
                lambda: all(kept_alive(s, granted) for s, granted in sessions),
                what="a keepalive confirmed for every session",
            )
            assert keepalive_streams_started(metrics) - before == 1
            assert not any(s.lost.is_set() for s, _ in sessions)
        finally:
            for session, _ in sessions:
                session.close()


def test_threads_do_not_grow_with_the_number_of_sessions(client: Client, before: int) -> None:
    """1 session, then 200 on the same client, each kept alive: the process has the same
    threads (a keepalive thread, a stream reader and gRPC's request thread per session
    before: 600 more)."""
    one = open_sessions(client, 1, ttl=3)
    poll(lambda: all(kept_alive(s, g) for s, g in one), what="the first keepalive")
    with_one = conch_threads()
    many = one + open_sessions(client, 199, ttl=3)
    try:
        poll(lambda: all(kept_alive(s, g) for s, g in many), what="every session kept alive")
        with_many = conch_threads()
        # Equal but for a thread of the pool winding down or starting (the stream opener
        # ends 5 s after its last open; gRPC's own come and go): a few, never per session.
        assert with_many <= with_one + 3, (with_one, with_many)
        assert with_many <= before + 40, (before, with_many)
    finally:
        for session, _ in many:
            session.close()


def test_threads_do_not_grow_with_the_number_of_waiters_and_holds(
    client: Client, name: str, before: int
) -> None:
    """One hold and one waiter on private sessions, then 200 holds of 200 semaphores and
    200 waiters behind them, each waiter on a thread of the application's and a private
    session: conch's threads stay as they were."""
    # A TTL of 10 s: 400 sessions keeping alive beside three other test workers on 2 cores
    # lost holds at 3 s (CI), and a lost hold's waiter is never seen queued behind it.
    semas = [conch.Semaphore(client, f"{name}-{i}", max=1, ttl=10) for i in range(200)]

    def queue_behind(count: int) -> tuple[list[conch.Hold], list[threading.Thread]]:
        holds = [sema.acquire(timeout=DEADLINE) for sema in semas[:count]]
        granted = {h.lease_id: h.session.alive_until for h in holds}
        waiters = [
            threading.Thread(target=_acquire_and_release, args=(sema,), name=APP, daemon=True)
            for sema in semas[:count]
        ]
        for waiter in waiters:
            waiter.start()
        poll(
            lambda: all(len(sema_keys(client, s.name)) == 2 for s in semas[:count]),
            what="every waiter queued",
        )
        # A keepalive confirmed on every hold's session: their stream is open.
        poll(
            lambda: all(kept_alive(h.session, granted[h.lease_id]) for h in holds),
            what="a keepalive confirmed on every hold",
        )
        return holds, waiters

    def drain(holds: list[conch.Hold], waiters: list[threading.Thread]) -> None:
        for hold in holds:
            hold.release()
        for waiter in waiters:
            waiter.join(DEADLINE)
            assert not waiter.is_alive()

    holds, waiters = queue_behind(1)
    with_one = conch_threads()
    drain(holds, waiters)
    holds, waiters = queue_behind(200)
    with_many = conch_threads()
    drain(holds, waiters)
    assert with_many <= with_one + 3, (with_one, with_many)
    assert with_many <= before + 40, (before, with_many)
    assert all(sema_keys(client, s.name) == [] for s in semas)


def _acquire_and_release(sema: conch.Semaphore) -> None:
    sema.acquire(timeout=DEADLINE).release()


def _all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP reaches them one by one:
    one still running may answer a keepalive after the signal was sent)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            states.append(stat.read().rsplit(")", 1)[1].split()[0])
    return all(state in ("T", "t") for state in states)


def _note_expiry(
    times: dict[int, tuple[float, float]], session: Session
) -> Callable[[object], None]:
    """A listener that notes when ``session`` told its expiry, and its E then."""

    def note(_: object) -> None:
        times.setdefault(session.lease_id, (time.monotonic(), session.alive_until))

    return note


def test_expiry_is_told_on_time_with_100_sessions_on_the_stream_and_none_is_lost(
    tmp_path: Path,
) -> None:
    """101 sessions (TTL 6 s) share the client's stream, and the client's timer is stuck in
    a step that waits (as a guard's call to a hung etcd does); etcd is stopped (SIGSTOP).
    Every session tells its holds that its earliest expiry E passed unconfirmed within half
    a second of E, never before it; and none of them is lost for that (etcd never said its
    lease was gone: a waiter on it keeps its place)."""
    ttl = 6
    cluster = EtcdCluster(tmp_path / "stopped")
    cluster.start()
    stuck = threading.Event()
    try:
        with cluster.client() as client:
            sessions = [s for s, _ in open_sessions(client, 101, ttl=ttl)]
            first = {id(s): s.alive_until for s in sessions}
            poll(
                lambda: all(s.alive_until > first[id(s)] for s in sessions),
                what="every session kept alive",
            )
            expired_at: dict[int, tuple[float, float]] = {}
            for session in sessions:
                session.on_expired(_note_expiry(expired_at, session))
            timer_for(client).call_later(0, lambda: stuck.wait(DEADLINE))
            member = cluster.members[0]
            member.pause()
            assert member.process is not None
            pid = member.process.pid
            poll(lambda: _all_stopped(pid), what="every thread of etcd stopped")
            poll(lambda: len(expired_at) == len(sessions), what="every expiry told")
            for session in sessions:
                told, expiry = expired_at[session.lease_id]
                assert told >= expiry, "told before E"
                assert told - expiry <= 0.5
                assert not session.lost.is_set(), session.lost.reason
            cluster.members[0].resume()
            for session in sessions:
                session.close()
    finally:
        stuck.set()
        cluster.members[0].resume()
        cluster.stop()
