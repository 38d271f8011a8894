"""Waiters that keep their place through faults that do not cost them their lease, and the
touch a holder promoted by a read owes at once: against real etcd servers, one private
server per fault (the shared one stays healthy for the other tests)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import conch
from conch.errors import EtcdError
from conch.etcd import Client, Endpoint, kv
from tests.conftest import DEADLINE, other_keys, poll, sema_keys
from tests.etcd_server import EtcdCluster


class Waiting:
    """One acquire on a thread of its own; ``hold`` or ``error`` once it is over."""

    def __init__(self, sema: conch.Semaphore, timeout: float, guard: bool = True) -> None:
        self.hold: conch.Hold | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sema, timeout, guard), daemon=True)
        self.thread.start()

    def _run(self, sema: conch.Semaphore, timeout: float, guard: bool) -> None:
        try:
            self.hold = sema.acquire(timeout=timeout, guard=guard)
        except BaseException as exc:
            self.error = exc

    def result(self) -> conch.Hold:
        self.thread.join(DEADLINE)
        assert self.hold is not None, f"no hold: {self.error!r}"
        return self.hold


def queue_up(client: Client, name: str, sema: conch.Semaphore, count: int) -> list[Waiting]:
    """``count`` waiters behind the keys already there, each seen in etcd before the next."""
    waiting = []
    already = len(sema_keys(client, name))
    for i in range(count):
        waiting.append(Waiting(sema, 90))
        poll(lambda n=already + i + 1: len(sema_keys(client, name)) == n, what=f"waiter {i}")  # type: ignore[misc]
    return waiting


@pytest.fixture
def private_etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    extra = getattr(request, "param", [])
    cluster = EtcdCluster(tmp_path / "etcd", size=1, extra=list(extra))
    cluster.start()
    yield cluster
    cluster.stop()


def test_waiters_keep_their_place_when_etcd_restarts_with_its_data_within_the_ttl(
    private_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd killed while three waiters queue behind a holder (each watching the key ahead,
    its standing read with its enqueue), and back on the same data dir and port once a
    waiter has met the refused connection: every lease (TTL 60 s) survived, so every waiter
    keeps its key and the slot goes around in the order they queued. Before, a waiter
    that read while etcd was down re-entered at the back with a new lease (its old key
    stayed, on a lease nobody kept alive, until it expired)."""
    caplog.set_level(logging.INFO, logger="conch")
    member = private_etcd.members[0]

    endpoints = [Endpoint.parse(member.endpoint)]
    with Client.connect(endpoints, dial_timeout=5, request_timeout=0.5) as client:
        sema = conch.Semaphore(client, name, max=1, ttl=60)
        holder = sema.acquire(timeout=10)
        waiting = queue_up(client, name, sema, 3)
        queued = [k.create_revision for k in sema_keys(client, name)][1:]
        member.kill()
        # Down until a waiter's watch or read was refused (request timeout 0.5 s), well
        # within one keepalive interval (20 s).
        poll(
            lambda: "event=etcd-away" in caplog.text or "event=requeue" in caplog.text,
            timeout=15,
            what="a waiter's watch or read refused",
        )
        member.start(private_etcd.initial_cluster, "existing")
        private_etcd.wait_healthy()
        holds: list[conch.Hold] = []
        previous = holder
        for each in waiting:
            previous.release()
            previous = each.result()
            holds.append(previous)
        previous.release()
        assert [h.revision for h in holds] == queued, "a waiter lost its place"
        assert "event=requeue" not in caplog.text
        assert poll(lambda: sema_keys(client, name) == [], what="every key gone")


def _fill_until_refused(client: Client) -> None:
    """Write until etcd's quota raises its space alarm (NOSPACE)."""
    blob = b"x" * 256 * 1024
    for i in range(200):
        try:
            kv.put(client, f"/fill/{i}".encode(), blob)
        except EtcdError as exc:
            assert "space" in str(exc), exc
            return
    raise AssertionError("etcd's quota never refused a write")


@pytest.mark.parametrize("private_etcd", [["--quota-backend-bytes=4194304"]], indirect=True)
def test_waiters_keep_their_place_while_etcd_refuses_writes(
    private_etcd: EtcdCluster, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under etcd's space alarm (NOSPACE) a release still hands the slot over (a revoke is
    not refused), but the touch of the waiter that moves up is. It keeps its place, tries
    the touch again later, and gets its slot when its turn comes; so does the waiter behind
    it. Before, that refused touch ejected the waiter (EtcdError, exit 69 from the command),
    and then the next one, every waiter but the new holder."""
    caplog.set_level(logging.INFO, logger="conch")
    with private_etcd.client() as client:
        sema = conch.Semaphore(client, name, max=1, ttl=10)
        holder = sema.acquire(timeout=10)
        waiting = queue_up(client, name, sema, 3)
        # The first waiter's touch, which pulls the second into the window, made before
        # the alarm: so the second is counting deletions when the alarm comes.
        poll(
            lambda: (
                sema_keys(client, name)[1].mod_revision > sema_keys(client, name)[1].create_revision
            ),
            what="the first waiter's touch",
        )
        queued = [k.create_revision for k in sema_keys(client, name)][1:]
        _fill_until_refused(client)
        holder.release()
        first = waiting[0].result()
        poll(
            lambda: "event=touch-failed" in caplog.text or not waiting[1].thread.is_alive(),
            what="the second waiter's refused touch",
        )
        assert waiting[1].error is None and waiting[2].error is None, (
            waiting[1].error,
            waiting[2].error,
        )
        assert [k.create_revision for k in sema_keys(client, name)] == queued
        first.release()
        second = waiting[1].result()
        second.release()
        third = waiting[2].result()
        third.release()
        assert [first.revision, second.revision, third.revision] == queued
        assert poll(lambda: sema_keys(client, name) == [], what="every key gone")


def test_a_holder_promoted_by_a_read_at_max_2_touches_before_its_guard_starts(
    client: Client, name: str
) -> None:
    """N=2: A and B hold, C queued behind other keys looks at the queue only after A left
    (woken by the last other key's deletion), and holds on that read; it never touched while
    waiting. Another holder (B) may leave any moment, so the waiter behind C must learn now
    that it is in the window: C's key is touched before its guard starts (the supervisor
    starts it only after the watchdog's handshake and the spawn). Before, the touch waited
    for ``start_guard()``."""
    a = conch.Semaphore(client, name, 2, ttl=5).acquire(timeout=10)
    b = conch.Semaphore(client, name, 2, ttl=5).acquire(timeout=10)
    with other_keys(client, name, 2, 3) as others:
        c = Waiting(conch.Semaphore(client, name, 2, ttl=5), 30, guard=False)
        poll(lambda: len(sema_keys(client, name, 2)) == 6, what="C queued")
        for key in others[:2]:
            kv.delete(client, key)
        a.release()
        kv.delete(client, others[2])
        hold = c.result()
    try:
        touched = poll(
            lambda: [
                k
                for k in sema_keys(client, name, 2)
                if k.key == hold.key and k.mod_revision > k.create_revision
            ],
            what="C's touch, its guard not started",
        )
        # guard=False: nothing starts C's guard but hold.start_guard(), called only now.
        assert touched
        hold.start_guard()
    finally:
        hold.release()
        b.release()
    assert sema_keys(client, name, 2) == []
