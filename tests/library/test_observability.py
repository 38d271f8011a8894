"""What a service watches conch with: log records with fields, the event hook, spans."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest

import conch
import conch.aio
import conch.events
from conch.etcd import Client, lease
from tests.conftest import poll
from tests.etcd_server import EtcdCluster


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Logger ``conch`` through python-json-logger, as a JSON log pipeline has it."""
    from pythonjsonlogger.json import JsonFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("conch")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def records(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.fixture
def events() -> Iterator[list[conch.events.Event]]:
    seen: list[conch.events.Event] = []
    unsubscribe = conch.events.subscribe(seen.append)
    try:
        yield seen
    finally:
        unsubscribe()


def test_a_json_handler_shows_conchs_fields_as_fields(
    client: Client, name: str, json_lines: io.StringIO
) -> None:
    sema = conch.Semaphore(client, name, max=2, ttl=5)
    with sema.acquire(timeout=10) as hold:
        pass
    by_event = {r["conch_event"]: r for r in records(json_lines) if "conch_event" in r}
    acquired = by_event["acquired"]
    assert acquired["conch_name"] == name
    assert acquired["max"] == 2
    assert acquired["rev"] == hold.revision
    assert acquired["lease"] == f"{hold.lease_id:x}"
    assert str(acquired["waited"]).endswith("s")
    assert acquired["levelname"] == "INFO"
    # the rendered message is the line as it was
    assert str(acquired["message"]).startswith(f"conch: event=acquired name={name} max=2 ")
    released = by_event["released"]
    assert released["rev"] == hold.revision and released["revoked"] is True
    assert str(released["held"]).endswith("s")
    assert by_event["session"]["lease"] == f"{hold.lease_id:x}"


def test_a_lost_hold_is_a_warning_record_with_its_reason(
    client: Client, name: str, json_lines: io.StringIO
) -> None:
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    with pytest.raises(conch.HoldLost), sema.acquire(timeout=10) as hold:
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(20)
    lost = poll(
        lambda: [r for r in records(json_lines) if r.get("conch_event") == "lost"],
        what="a lost record",
    )[0]
    assert lost["levelname"] == "WARNING"
    assert lost["rev"] == hold.revision and lost["conch_name"] == name
    assert lost["reason"]


def test_the_hook_sees_queued_acquired_released_with_the_figures(
    client: Client, name: str, events: list[conch.events.Event]
) -> None:
    """A waiter behind a holder: queued second (the holder's key is ahead), acquired once
    the holder releases (its wait covers the hold), released with its hold time."""
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    first = sema.acquire(timeout=10)
    got: list[conch.Hold] = []
    waiter = threading.Thread(target=lambda: got.append(sema.acquire(timeout=20)))
    waiter.start()
    queued = poll(lambda: [e for e in events if isinstance(e, conch.events.Queued)], what="queued")[
        0
    ]
    assert queued.name == name and queued.max == 1
    assert queued.position == 2 and queued.ahead == 1
    first.release()
    waiter.join(30)
    second = got[0]
    second.release()
    acquired = [e for e in events if isinstance(e, conch.events.Acquired)]
    assert [a.revision for a in acquired] == [first.revision, second.revision]
    assert acquired[1].revision == queued.revision
    assert acquired[1].lease_id == second.lease_id and acquired[1].max == 1
    released = [e for e in events if isinstance(e, conch.events.Released)]
    assert [r.revision for r in released] == [first.revision, second.revision]
    # the second waited at least as long as the first was held, by the same clock
    assert released[0].held is not None and acquired[1].waited >= released[0].held - 0.05
    assert all(r.revoked and not r.after_loss for r in released)


def test_waiters_behind_the_window_are_told_their_place_in_the_queue(
    client: Client, name: str, events: list[conch.events.Event]
) -> None:
    """A holder and five waiters queued one after another at max 1: each one's ``queued``
    says how many keys are ahead of it, past the window (3 keys) too, where the count is
    etcd's (a count-only Range at the revision before our key)."""
    sema = conch.Semaphore(client, name, max=1, ttl=10)
    holder = sema.acquire(timeout=10)
    held: list[int] = []

    def take_turn() -> None:
        with sema.acquire(timeout=60) as hold:
            held.append(hold.revision)

    def queued_events() -> list[conch.events.Queued]:
        return [e for e in events if isinstance(e, conch.events.Queued)]

    waiters: list[threading.Thread] = []
    try:
        for i in range(5):
            waiters.append(threading.Thread(target=take_turn))
            waiters[-1].start()
            poll(lambda: len(queued_events()) == len(waiters), what=f"waiter {i} queued")
        queued = queued_events()
        assert [(q.position, q.ahead) for q in queued] == [(i + 2, i + 1) for i in range(5)]
    finally:
        holder.release()
        for waiter in waiters:
            waiter.join(60)
    assert held == sorted(q.revision for q in queued)


def test_the_hook_runs_with_logging_off_and_a_failing_callback_harms_nothing(
    client: Client, name: str, events: list[conch.events.Event]
) -> None:
    def broken(event: conch.events.Event) -> None:
        raise RuntimeError("a dashboard's bug")

    unsubscribe = conch.events.subscribe(broken)
    logger = logging.getLogger("conch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10).release()
    finally:
        logger.setLevel(level)
        unsubscribe()
    assert [type(e) for e in events] == [conch.events.Acquired, conch.events.Released]


def test_the_hook_sees_an_asyncio_hold_and_its_loss(
    etcd: EtcdCluster, client: Client, name: str, events: list[conch.events.Event]
) -> None:
    async def main() -> int:
        async with conch.aio.connect(etcd.endpoints) as aclient:
            sema = conch.aio.Semaphore(aclient, name, max=1, ttl=5)
            hold = await sema.acquire(timeout=10)
            lease.revoke(client, hold.lease_id)
            await asyncio.wait_for(hold.lost.wait(), 20)
            await hold.release()
            return hold.revision

    revision = asyncio.run(main())
    kinds = [type(e) for e in events]
    assert kinds == [conch.events.Acquired, conch.events.Lost, conch.events.Released], kinds
    lost = events[1]
    assert isinstance(lost, conch.events.Lost) and lost.revision == revision and lost.reason
    released = events[2]
    assert isinstance(released, conch.events.Released) and released.after_loss


def test_unsubscribe_stops_the_events(
    client: Client, name: str, events: list[conch.events.Event]
) -> None:
    more: list[conch.events.Event] = []
    unsubscribe = conch.events.subscribe(more.append)
    unsubscribe()
    unsubscribe()  # idempotent
    conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10).release()
    assert more == [] and len(events) == 2


def test_the_otel_extra_makes_acquire_and_hold_spans(client: Client, name: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    import conch.otel

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stop = conch.otel.instrument(provider)
    try:
        sema = conch.Semaphore(client, name, max=1, ttl=5)
        with sema.acquire(timeout=10) as kept:
            pass
        with pytest.raises(conch.HoldLost), sema.acquire(timeout=10) as lost:
            lease.revoke(client, lost.lease_id)
            assert lost.lost.wait(20)
    finally:
        stop()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["conch.acquire", "conch.hold"] * 2
    acquire, hold = spans[0], spans[1]
    assert acquire.attributes is not None and hold.attributes is not None
    assert acquire.attributes["conch.name"] == name
    assert acquire.attributes["conch.revision"] == kept.revision
    assert hold.attributes["conch.lease"] == f"{kept.lease_id:x}"
    assert acquire.end_time == hold.start_time
    assert hold.status.status_code == StatusCode.UNSET
    lost_span = spans[3]
    assert lost_span.attributes is not None
    assert lost_span.attributes["conch.revision"] == lost.revision
    assert lost_span.status.status_code == StatusCode.ERROR
    assert [e.name for e in lost_span.events] == ["conch.lost"]


def test_the_prometheus_example_counts_waits_holds_and_losses(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    import prometheus_client

    from examples.prometheus_metrics import ConchMetrics

    registry = prometheus_client.CollectorRegistry()
    stop = ConchMetrics(registry).install()

    def value(metric: str, **labels: str) -> float | None:
        return registry.get_sample_value(metric, {"name": name, **labels})

    try:
        sema = conch.Semaphore(client, name, max=1, ttl=5)
        first = sema.acquire(timeout=10)
        assert value("conch_holds") == 1
        got: list[conch.Hold] = []
        waiter = threading.Thread(target=lambda: got.append(sema.acquire(timeout=20)))
        waiter.start()
        poll(lambda: value("conch_queued_position") == 2, what="the waiter queued")
        first.release()
        waiter.join(30)
        lease.revoke(client, got[0].lease_id)
        assert got[0].lost.wait(20)
        got[0].release()
    finally:
        stop()
    assert value("conch_acquire_wait_seconds_count") == 2
    assert value("conch_hold_seconds_count") == 2
    assert value("conch_holds") == 0
    assert value("conch_lost_total") == 1
