"""Hooks: a callback for each hold's transitions, for metrics and tracing.

    import conch.events

    def on_event(event: conch.events.Event) -> None:
        if isinstance(event, conch.events.Acquired):
            wait_seconds.observe(event.waited)

    unsubscribe = conch.events.subscribe(on_event)

Every transition conch logs (``conch.log``: both faces and the command) is also handed to
each subscribed callback as a typed event (``Queued``, ``Acquired``, ``Released``,
``Lost``), whether or not the ``conch`` logger is enabled; figures in seconds (floats),
revisions as etcd numbers them. A callback runs synchronously on the thread (or event loop)
that made the transition, often a conch thread (the keepalive thread declares a loss):
never block in it. An exception it raises is swallowed; the other callbacks still run.
``subscribe`` is thread-safe; the subscribers are the process's, for every client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from conch import log

__all__ = ["Acquired", "Event", "Lost", "Queued", "Released", "subscribe"]


@dataclass(frozen=True)
class Queued:
    """Our waiter key is in the queue of ``name``[``max``] at create_revision ``revision``
    (its fencing token, if it gets the slot). ``position``: our place among every key of
    the semaphore by create_revision, holders included, counted when it queued (None when
    etcd could not be asked); ``ahead`` = position - 1."""

    name: str
    max: int
    revision: int
    position: int | None
    ahead: int | None


@dataclass(frozen=True)
class Acquired:
    """A slot of ``name``[``max``] is held: ``revision`` is the fencing token, ``lease_id``
    the session's lease, ``waited`` the seconds from the call to ``acquire`` to the hold."""

    name: str
    max: int
    revision: int
    lease_id: int
    waited: float


@dataclass(frozen=True)
class Released:
    """The hold of ``name`` at ``revision`` was given back after ``held`` seconds (None if
    not known). ``revoked``: etcd confirmed the revoke (or the delete); else the key goes
    when its lease expires. ``after_loss``: the hold had been lost first."""

    name: str
    revision: int
    held: float | None
    revoked: bool
    after_loss: bool


@dataclass(frozen=True)
class Lost:
    """The hold of ``name`` at ``revision`` was lost; ``reason`` says why, as HoldLost does."""

    name: str
    revision: int
    reason: str


Event = Queued | Acquired | Released | Lost
Callback = Callable[[Event], None]

_lock = threading.Lock()
_callbacks: tuple[Callback, ...] = ()


def subscribe(callback: Callback) -> Callable[[], None]:
    """Call ``callback(event)`` for every event of every hold in this process, from now on.
    Returns the function that unsubscribes it (idempotent)."""
    global _callbacks
    with _lock:
        _callbacks = (*_callbacks, callback)

    def unsubscribe() -> None:
        global _callbacks
        with _lock:
            rest = list(_callbacks)
            if callback in rest:
                rest.remove(callback)
            _callbacks = tuple(rest)

    return unsubscribe


def _seconds(value: object) -> float | None:
    """A duration as the log line has it (``"1.204s"``), in seconds; None if it is none."""
    with contextlib.suppress(ValueError):
        return float(str(value).removesuffix("s"))
    return None


def _int(value: object, base: int = 10) -> int | None:
    with contextlib.suppress(ValueError):
        return int(str(value), base)
    return None


def _event(event: str, fields: dict[str, object]) -> Event | None:
    if (revision := _int(fields.get("rev"))) is None:
        return None
    name = str(fields.get("name", ""))
    size = _int(fields.get("max", 0)) or 0
    if event == "queued":
        return Queued(name, size, revision, _int(fields.get("position")), _int(fields.get("ahead")))
    if event == "acquired":
        lease_id = _int(fields.get("lease", "0"), 16) or 0
        return Acquired(name, size, revision, lease_id, _seconds(fields.get("waited", 0)) or 0.0)
    if event == "released":
        held = _seconds(fields.get("held"))
        revoked = fields.get("revoked") is True
        return Released(name, revision, held, revoked, fields.get("after") == "loss")
    if event == "lost":
        return Lost(name, revision, str(fields.get("reason", "")))
    return None


def _dispatch(event: str, fields: dict[str, object]) -> None:
    typed = _event(event, fields) if _callbacks else None
    if typed is not None:
        for callback in _callbacks:
            with contextlib.suppress(Exception):  # a hook's failure is not conch's
                callback(typed)


log.hook = _dispatch
