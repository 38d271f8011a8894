"""Variants of ``conch.core.waiter.Waiter`` for the simulator's own tests.

The *broken* ones each carry one known mistake; the simulator must catch every one of them
(a property that no schedule can fail proves nothing).
"""

from __future__ import annotations

from conch.core import messages as m
from conch.core import waiter as r


class OverCounting(r.Waiter):
    """Counts one slot too many: holds with N keys ahead of it (safety)."""

    def __init__(self, prefix: bytes, max_holders: int, *args: object, **kwargs: object) -> None:
        super().__init__(prefix, max_holders + 1, *args, **kwargs)  # type: ignore[arg-type]


class NoGapCheck(r.Waiter):
    """Trusts its watch from "now" and never reads the keys again once etcd confirms it,
    so a change between its read and the watch's start is missed (liveness)."""

    def _on_watch(self, event: m.WatchCreated | m.WatchEvents | m.WatchBroken) -> list[m.Action]:
        if isinstance(event, m.WatchCreated):
            return []
        return super()._on_watch(event)


class NoRewatch(r.Waiter):
    """Ignores a broken or compacted watch: sleeps on without one (liveness)."""

    def _on_watch(self, event: m.WatchCreated | m.WatchEvents | m.WatchBroken) -> list[m.Action]:
        if isinstance(event, m.WatchBroken):
            return []
        return super()._on_watch(event)


class NoWithdraw(r.Waiter):
    """Gives up without taking its key out or closing its session (nothing left behind)."""

    def _withdraw(self) -> list[m.Action]:
        self.state = r.State.WITHDRAWING
        return self._after_withdraw()


BROKEN: dict[str, type[r.Waiter]] = {
    "over-counting": OverCounting,
    "no-gap-check": NoGapCheck,
    "no-rewatch": NoRewatch,
    "no-withdraw": NoWithdraw,
}
