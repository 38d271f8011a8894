"""Variants of ``conch.core.waiter.Waiter`` and of the codec's read plan
(``conch.core.codec.ReadTogether``) for the simulator's own tests.

The *broken* ones each carry one known mistake; the simulator must catch every one of them
(a property that no schedule can fail proves nothing).
"""

from __future__ import annotations

from conch.core import codec
from conch.core import messages as m
from conch.core import waiter as r
from conch.errors import EtcdError


class OverCounting(r.Waiter):
    """Counts one slot too many: holds with N keys ahead of it (safety)."""

    def __init__(self, prefix: bytes, max_holders: int, *args: object, **kwargs: object) -> None:
        super().__init__(prefix, max_holders + 1, *args, **kwargs)  # type: ignore[arg-type]


class NoGapCheck(r.Waiter):
    """Trusts its watch from "now" and never reads the keys again once etcd confirms it,
    so a change between its read and the watch's start is missed (liveness)."""

    def _on_watch(self, event: m.Watched) -> list[m.Action]:
        if event.created:
            return []
        return super()._on_watch(event)


class NoRewatch(r.Waiter):
    """Ignores a broken or compacted watch: sleeps on without one (liveness)."""

    def _on_watch(self, event: m.Watched) -> list[m.Action]:
        if event.ended:
            return []
        return super()._on_watch(event)


class CountsBeforeGapCheck(r.Waiter):
    """Counts window events while the gap check is unanswered, as the recipe did before
    the fix the simulator's seeds 1568 and 1698 found: a key deleted between the queue read
    and the watch's start is held (safety)."""

    def _on_watch(self, event: m.Watched) -> list[m.Action]:
        if (
            not (event.created or event.ended)
            and event.id == self._watch
            and self.state == r.State.IN_WINDOW
            and self._asked is m.ReadKeys
            and self._request is not None
        ):
            return self._window_events(event)
        return super()._on_watch(event)


class NoWithdraw(r.Waiter):
    """Gives up without taking its key out or closing its session (nothing left behind)."""

    def _withdraw(self) -> list[m.Action]:
        self.state = r.State.WITHDRAWING
        self._request = next(self._ids)
        return self._withdrawing(m.Over(self._request))  # withdrawn at once


class NoSpaceFallback(codec.ReadTogether):
    """Reads with one read-only Txn only, never falling back to Ranges when etcd refuses
    it under its space alarm, as conch's asyncio face did (liveness)."""

    def refused(self, error: EtcdError) -> None:
        raise error


BROKEN: dict[str, type[r.Waiter]] = {
    "over-counting": OverCounting,
    "no-gap-check": NoGapCheck,
    "no-rewatch": NoRewatch,
    "no-withdraw": NoWithdraw,
    "counts-before-gap-check": CountsBeforeGapCheck,
}
BROKEN_READS: dict[str, type[codec.ReadTogether]] = {"no-space-fallback": NoSpaceFallback}
