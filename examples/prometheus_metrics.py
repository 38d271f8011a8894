"""Prometheus metrics for conch's holds, on the hooks of ``conch.events``.

    import prometheus_client
    from examples.prometheus_metrics import ConchMetrics

    ConchMetrics().install()               # into prometheus_client's default registry
    prometheus_client.start_http_server(9100)

What a dashboard for "at most N calls to the billing cluster" wants, per semaphore name:

- ``conch_acquire_wait_seconds`` (histogram): from ``acquire()`` to the hold;
- ``conch_hold_seconds`` (histogram): from the hold to its release;
- ``conch_holds`` (gauge): holds of this process right now;
- ``conch_queued_position`` (gauge): the place the last waiter queued at (holders included);
- ``conch_lost_total`` (counter): holds lost (lease gone, key deleted);
- ``conch_release_unconfirmed_total`` (counter): releases etcd did not confirm (the key
  goes at its lease's TTL).

prometheus_client is not a dependency of conch; ``pip install prometheus-client``.
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client

import conch.events


class ConchMetrics:
    """The metrics above, in ``registry`` (prometheus_client's default one when None)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        registry = registry or prometheus_client.REGISTRY
        labels = ["name"]
        self.wait = prometheus_client.Histogram(
            "conch_acquire_wait_seconds",
            "Seconds from acquire() to the hold",
            labels,
            registry=registry,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.held = prometheus_client.Histogram(
            "conch_hold_seconds",
            "Seconds from the hold to its release",
            labels,
            registry=registry,
            buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
        )
        self.holds = prometheus_client.Gauge(
            "conch_holds", "Holds of this process now", labels, registry=registry
        )
        self.position = prometheus_client.Gauge(
            "conch_queued_position",
            "The place the last waiter queued at, holders included",
            labels,
            registry=registry,
        )
        self.lost = prometheus_client.Counter("conch_lost", "Holds lost", labels, registry=registry)
        self.unconfirmed = prometheus_client.Counter(
            "conch_release_unconfirmed",
            "Releases etcd did not confirm",
            labels,
            registry=registry,
        )

    def on_event(self, event: conch.events.Event) -> None:
        """The hook: quick, never blocks (it runs on conch's threads or the loop)."""
        if isinstance(event, conch.events.Queued):
            if event.position is not None:
                self.position.labels(event.name).set(event.position)
        elif isinstance(event, conch.events.Acquired):
            self.wait.labels(event.name).observe(event.waited)
            self.holds.labels(event.name).inc()
        elif isinstance(event, conch.events.Released):
            self.holds.labels(event.name).dec()
            if event.held is not None:
                self.held.labels(event.name).observe(event.held)
            if not event.revoked:
                self.unconfirmed.labels(event.name).inc()
        elif isinstance(event, conch.events.Lost):
            self.lost.labels(event.name).inc()

    def install(self) -> Callable[[], None]:
        """Subscribe to conch's events; returns the function that unsubscribes."""
        return conch.events.subscribe(self.on_event)
