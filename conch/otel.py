"""OpenTelemetry spans for conch's holds, on the hooks of ``conch.events``.

    pip install 'conch[otel]'      # opentelemetry-api; the SDK and exporter are yours

    import conch.otel

    stop = conch.otel.instrument()   # the global tracer provider, or tracer_provider=...

Two spans per hold, in the process that holds it: ``conch.acquire``, from the call to
``acquire()`` to the hold (the acquired moment less ``waited``), and ``conch.hold``, from the
hold to its release or loss (a loss: an ERROR status with the reason, and a ``conch.lost``
event). Attributes: ``conch.name``, ``conch.max``, ``conch.revision`` (the fencing token),
``conch.lease`` (hex), ``conch.waited_s``, and ``conch.queue.position`` on the acquire span
when the wait queued. Spans have a parent only if one is current where the transition
happens (``queued`` and ``acquired`` are on the caller's thread or task). Waits that end
without a hold make no span. ``import conch`` never imports OpenTelemetry.
"""

from __future__ import annotations

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
    # One dict operation at a time, each atomic: no lock is needed between the threads.
    holds: dict[tuple[str, int], trace.Span] = {}
    positions: dict[tuple[str, int], int] = {}

    def on_event(event: events.Event) -> None:
        key = (event.name, event.revision)
        if isinstance(event, events.Queued) and event.position is not None:
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
            queued = {"conch.queue.position": positions.pop(key)} if key in positions else {}
            start = now - int(event.waited * 1e9)
            tracer.start_span(
                "conch.acquire", start_time=start, attributes={**attributes, **queued}
            ).end(end_time=now)
            holds[key] = tracer.start_span("conch.hold", start_time=now, attributes=attributes)
        elif isinstance(event, events.Lost) and (lost := holds.get(key)) is not None:
            lost.add_event("conch.lost", {"conch.reason": event.reason})
            lost.set_status(trace.Status(trace.StatusCode.ERROR, event.reason))
        elif isinstance(event, events.Released) and (ended := holds.pop(key, None)) is not None:
            ended.set_attribute("conch.revoked", event.revoked)
            ended.end()

    return events.subscribe(on_event)
