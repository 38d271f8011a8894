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
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from conch import log
from conch.timer import listen

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

# Each subscription under a key of its own: one dict operation at a time, atomic, no lock.
_callbacks: dict[object, Callback] = {}
_T = TypeVar("_T", int, float)


def subscribe(callback: Callback) -> Callable[[], None]:
    """Call ``callback(event)`` for every event of every hold in this process, from now on.
    Returns the function that unsubscribes it (idempotent)."""
    return listen(_callbacks, callback)


def _read(parse: Callable[[str], _T], value: object) -> _T | None:
    """``value`` as the log line has it (a duration: ``"1.204s"``); None if it is none."""
    with contextlib.suppress(ValueError):
        return parse(str(value).removesuffix("s") if parse is float else str(value))
    return None


def _dispatch(event: str, fields: dict[str, object]) -> None:
    if not _callbacks or (revision := _read(int, fields.get("rev"))) is None:
        return
    name = str(fields.get("name", ""))
    size = _read(int, fields.get("max", 0)) or 0
    typed: Event
    if event == "queued":
        position, ahead = _read(int, fields.get("position")), _read(int, fields.get("ahead"))
        typed = Queued(name, size, revision, position, ahead)
    elif event == "acquired":
        lease_id = _read(functools.partial(int, base=16), fields.get("lease", "0")) or 0
        waited = _read(float, fields.get("waited", 0)) or 0.0
        typed = Acquired(name, size, revision, lease_id, waited)
    elif event == "released":
        held = _read(float, fields.get("held"))
        revoked = fields.get("revoked") is True
        typed = Released(name, revision, held, revoked, fields.get("after") == "loss")
    elif event == "lost":
        typed = Lost(name, revision, str(fields.get("reason", "")))
    else:
        return
    for callback in tuple(_callbacks.values()):
        with contextlib.suppress(Exception):  # a hook's failure is not conch's
            callback(typed)


log.hook = _dispatch
