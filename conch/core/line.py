"""The waiters of one semaphore in one process (on one client), ranked by their keys'
create_revision: a waiter behind others of its process that still wait cannot hold before
them, so past the first ``limit`` (the window's waiters) its standing read is parked until
enough of those ahead have held or gone. Why, and what it saved: docs/design.md, "Many
waiters in one process". Parking only delays a read: every decision stays the Waiter's.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from conch.core.messages import KeyRev

M = TypeVar("M", bound=Hashable)  # a member: a face's driver


class Line(Generic[M]):
    """Members (a face's drivers) with their key's create_revision, 0 while unknown (then
    counted as ahead of everyone: its enqueue may land first); the first ``limit`` read
    freely. ``joined``, ``placed``, ``park`` and ``leave`` keep it; those that can change who
    may read return the parked members that may read now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._members: dict[M, int] = {}
        self._waiting: list[int] = []  # the members' known revisions, ascending
        self._parked: dict[int, M] = {}  # a parked member by its revision
        self._parked_order: list[int] = []  # their revisions, ascending
        self.head: tuple[int, list[KeyRev]] = (0, [])  # the first keys read last, and when

    def seen(self, events: Sequence[KeyRev]) -> None:
        """A key deleted after ``head`` was read leaves it (what it held of that name is gone)."""
        revision, keys = self.head
        gone = {e.key for e in events if e.deleted and e.mod_revision > revision}
        self.head = revision, [k for k in keys if k.key not in gone]

    def __len__(self) -> int:
        return len(self._members)

    def joined(self, member: M) -> bool:
        """``member`` enqueues: whether fewer than ``limit`` others are in line (its Txn reads)."""
        self._members.setdefault(member, 0)
        return len(self._members) <= self.limit

    def placed(self, member: M, revision: int) -> list[M]:
        """``member``'s key is at ``revision`` now (0: it has none, re-entering)."""
        self._forget(member)
        self._members[member] = revision
        if revision:
            bisect.insort(self._waiting, revision)
        return self._next()

    def park(self, member: M, revision: int) -> bool:
        """Whether ``member``, whose key is at ``revision``, must wait to read its standing:
        ``limit`` earlier members still wait. If so it is parked until ``leave`` or
        ``placed`` say."""
        if self._ahead(revision) < self.limit:
            return False
        self._parked[revision] = member
        bisect.insort(self._parked_order, revision)
        return True

    def leave(self, member: M) -> list[M]:
        """``member`` holds a slot or gives up (its deadline came): it waits no more."""
        self._forget(member)
        return self._next()

    def _forget(self, member: M) -> None:
        revision = self._members.pop(member, 0)
        if self._parked.get(revision) is member:
            del self._parked[revision]
            self._parked_order.remove(revision)
        if revision:
            del self._waiting[bisect.bisect_left(self._waiting, revision)]

    def _ahead(self, revision: int) -> int:
        unknown = len(self._members) - len(self._waiting)
        return bisect.bisect_left(self._waiting, revision) + unknown

    def _next(self) -> list[M]:
        # The earliest parked members first: none behind one that must wait may read.
        woken = []
        while self._parked_order and self._ahead(self._parked_order[0]) < self.limit:
            woken.append(self._parked.pop(self._parked_order.pop(0)))
        return woken
