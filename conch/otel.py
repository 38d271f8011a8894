"""OpenTelemetry spans for conch's holds, on the hooks of ``conch.events``.

    pip install 'conch[otel]'      # opentelemetry-api; the SDK and exporter are yours

    import conch.otel

    stop = conch.otel.instrument()   # the global tracer provider, or tracer_provider=...

Two spans per hold, in the process that holds it: ``conch.acquire``, from the call to
``acquire()`` to the hold (its start is the acquired moment less the ``waited`` figure), and
``conch.hold``, from the hold to its release or loss (a loss ends it with an ERROR status and
the reason, and a ``conch.lost`` event). Attributes: ``conch.name``, ``conch.max``,
``conch.revision`` (the fencing token), ``conch.lease`` (hex), ``conch.waited_s``;
``conch.queue.position`` on the acquire span when the wait queued. Spans have no parent
unless one is current where the transition happens (the acquire's, when ``acquire()`` is
called in one: the hook runs on the caller's thread or task for ``queued`` and
``acquired``). Waits that end without a hold (NoSlot, a cancel) make no span.

A dependency of the ``otel`` extra only: ``import conch`` never imports OpenTelemetry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from opentelemetry import trace

from conch import __version__, events

__all__ = ["instrument"]


def instrument(tracer_provider: trace.TracerProvider | None = None) -> Callable[[], None]:
    """Start making spans for every hold of this process (``tracer_provider``: the global
    one when None). Returns the function that stops it (idempotent); a hold under way then
    keeps its open span until it ends."""
    tracer = trace.get_tracer("conch", __version__, tracer_provider=tracer_provider)
    lock = threading.Lock()
    holds: dict[tuple[str, int], trace.Span] = {}
    positions: dict[tuple[str, int], int] = {}

    def on_event(event: events.Event) -> None:
        key = (event.name, event.revision)
        if isinstance(event, events.Queued):
            if event.position is not None:
                with lock:
                    positions[key] = event.position
        elif isinstance(event, events.Acquired):
            now = time.time_ns()
            attributes: dict[str, str | int | float] = {
                "conch.name": event.name,
                "conch.max": event.max,
                "conch.revision": event.revision,
                "conch.lease": f"{event.lease_id:x}",
                "conch.waited_s": event.waited,
            }
            with lock:
                position = positions.pop(key, None)
            acquire = tracer.start_span(
                "conch.acquire",
                start_time=now - int(event.waited * 1e9),
                attributes=attributes
                if position is None
                else {**attributes, "conch.queue.position": position},
            )
            acquire.end(end_time=now)
            hold = tracer.start_span("conch.hold", start_time=now, attributes=attributes)
            with lock:
                holds[key] = hold
        elif isinstance(event, events.Lost):
            with lock:
                lost = holds.get(key)
            if lost is not None:
                lost.add_event("conch.lost", {"conch.reason": event.reason})
                lost.set_status(trace.Status(trace.StatusCode.ERROR, event.reason))
        elif isinstance(event, events.Released):
            with lock:
                ended = holds.pop(key, None)
            if ended is not None:
                ended.set_attribute("conch.revoked", event.revoked)
                ended.end()

    return events.subscribe(on_event)
