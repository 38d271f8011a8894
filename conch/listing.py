"""The listing of a semaphore's keys (``--who``): one Record per holder or waiter."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conch import keys
from conch.etcd import kv
from conch.etcd.client import Client
from conch.keys import MAX_CAPACITY


@dataclass(frozen=True)
class Record:
    """One key of ``who()``: ``state`` HELD or WAIT; ``held`` how many slots of (name, max)
    are taken; ``rev`` the key's create_revision; ``lease`` hex. ``note`` says what is wrong
    with a key conch did not write (bad JSON, no lease, bad capacity), empty otherwise."""

    name: str
    max: int | None
    held: int
    state: str
    host: str
    pid: int | None
    started: str
    rev: int
    lease: str
    cmd: str
    note: str = ""

    def to_text(self) -> str:
        """One line, fields in a fixed order; a field with spaces or unprintable characters
        (written by someone else) is shown JSON-quoted so it cannot forge another line."""
        capacity = "?" if self.max is None else str(self.max)
        line = (
            f"{self.name}[{self.held}/{capacity}] {self.state:<4}  {_quoted(self.host)} "
            f"pid={self.pid if self.pid is not None else '?'} "
            f"since={_quoted(self.started or '?')} "
            f"rev={self.rev}"
        )
        return line + (f" note={self.note}" if self.note else "")

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "max": self.max,
                "state": self.state,
                "host": self.host,
                "pid": self.pid,
                "started": self.started,
                "rev": self.rev,
                "lease": self.lease,
                "cmd": self.cmd,
                **({"note": self.note} if self.note else {}),
            },
            ensure_ascii=False,
        )


def _quoted(text: str) -> str:
    if text.isprintable() and " " not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _identity_fields(value: bytes) -> tuple[str, int | None, str, str, str]:
    """host, pid, started, cmd, note from a key's value; tolerant of anything."""
    try:
        data = json.loads(value)
        if not isinstance(data, dict):
            raise ValueError
    except (ValueError, RecursionError):
        return "?", None, "", "", "malformed-value"
    pid = data.get("pid")
    return (
        _as_text(data.get("host"), "?"),
        pid if type(pid) is int else None,
        _as_text(data.get("started"), ""),
        _as_text(data.get("cmd"), ""),
        "",
    )


def _as_text(value: object, missing: str) -> str:
    """A field of a key's JSON value as text: a string as it is, anything else as JSON."""
    if value is None:
        return missing
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """Every key under ``name`` (all capacities), in create_revision order per capacity; the
    capacity ``max_holders`` first when given. One KV.Range; reads only (no lease)."""
    prefix = keys.name_prefix(name)
    response = kv.range_prefix(client, prefix, sort_target=kv.CREATE, sort_order=kv.ASCEND)
    groups: dict[int | None, list[Any]] = {}
    for item in response.kvs:
        parsed = keys.parse_under_name(name, item.key)
        capacity = parsed.max if parsed else None
        if capacity is not None and not 1 <= capacity <= MAX_CAPACITY:
            capacity = None  # no conch writes it: a bad key
        groups.setdefault(capacity, []).append(item)

    def order(capacity: int | None) -> tuple[int, int]:
        if capacity == max_holders and capacity is not None:
            return (0, 0)
        return (1, capacity if capacity is not None else 1 << 62)

    records = []
    for capacity in sorted(groups, key=order):
        items = groups[capacity]
        held = min(len(items), capacity) if capacity is not None else 0
        for rank, item in enumerate(items):
            host, pid, started, cmd, note = _identity_fields(item.value)
            notes = [note] if note else []
            if capacity is None:
                notes.append("bad-key")
            if not item.lease:
                notes.append("no-lease")
            state = "HELD" if capacity is not None and rank < capacity else "WAIT"
            records.append(
                Record(
                    name,
                    capacity,
                    held,
                    state,
                    host,
                    pid,
                    started,
                    int(item.create_revision),
                    f"{item.lease:x}",
                    cmd,
                    ",".join(notes),
                )
            )
    return records
