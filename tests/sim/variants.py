"""Variants of ``conch.recipe.Waiter`` for the simulator's own tests.

The *broken* ones each carry one known mistake; the simulator must catch every one of them
(a property that no schedule can fail proves nothing). ``GapCheckedFirst`` is the fix the
simulator's findings call for (docs/design.md, "What the simulator explores"): shown
passing the schedules that fail the recipe as it is, so the fix is more than a guess.
"""

from __future__ import annotations

from conch import recipe as r


class OverCounting(r.Waiter):
    """Counts one slot too many: holds with N keys ahead of it (safety)."""

    def __init__(self, prefix: bytes, max_holders: int, *args: object, **kwargs: object) -> None:
        super().__init__(prefix, max_holders + 1, *args, **kwargs)  # type: ignore[arg-type]


class NoGapCheck(r.Waiter):
    """Trusts its watch from "now" and never reads the keys again once etcd confirms it,
    so a change between its read and the watch's start is missed (liveness)."""

    def _on_watch(self, event: r.WatchCreated | r.WatchEvents | r.WatchBroken) -> list[r.Action]:
        if isinstance(event, r.WatchCreated):
            return []
        return super()._on_watch(event)


class NoRewatch(r.Waiter):
    """Ignores a broken or compacted watch: sleeps on without one (liveness)."""

    def _on_watch(self, event: r.WatchCreated | r.WatchEvents | r.WatchBroken) -> list[r.Action]:
        if isinstance(event, r.WatchBroken):
            return []
        return super()._on_watch(event)


class NoWithdraw(r.Waiter):
    """Gives up without taking its key out or closing its session (nothing left behind)."""

    def _withdraw(self) -> list[r.Action]:
        self.state = r.State.WITHDRAWING
        return self._after_withdraw()


BROKEN: dict[str, type[r.Waiter]] = {
    "over-counting": OverCounting,
    "no-gap-check": NoGapCheck,
    "no-rewatch": NoRewatch,
    "no-withdraw": NoWithdraw,
}


class GapCheckedFirst(r.Waiter):
    """The recipe with window events held back while the gap check (the ReadKeys after
    WatchCreated) is in flight, and replayed only once it says nothing changed: a deletion
    of our own key in the gap is then seen before any event can make us hold."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._held_back: list[r.WatchEvents] = []

    def _gap_pending(self) -> bool:
        return self._request is not None and self._asked is r.ReadKeys

    def _on_watch(self, event: r.WatchCreated | r.WatchEvents | r.WatchBroken) -> list[r.Action]:
        if (
            isinstance(event, r.WatchEvents)
            and event.id == self._watch
            and self.state == r.State.IN_WINDOW
            and self._gap_pending()
        ):
            self._held_back.append(event)
            return []
        return super()._on_watch(event)

    def _gap_checked(self, answer: r.KeysAnswer) -> list[r.Action]:
        held_back, self._held_back = self._held_back, []
        actions = super()._gap_checked(answer)
        if actions:
            return actions  # a change in the gap: re-reading, those events are moot
        for event in held_back:
            if self.state != r.State.IN_WINDOW:
                break
            actions += self._on_watch(event)
        return actions
