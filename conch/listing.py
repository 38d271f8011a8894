"""The listing of a semaphore's keys (``--who``): one Record per holder or waiter. Ages are
the reader's clock against each key's ``started`` (etcd keeps no time), floored at 0; hold
times are etcd's view at each holder's create_revision (docs/design.md, "How --who tells")."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from conchpb.etcdserverpb import rpc_pb2

from conch import keys
from conch.core import codec
from conch.errors import Compacted
from conch.etcd import kv
from conch.etcd.client import Client
from conch.semaphore import drive

HISTORY_READS = 100  # at most this many reads (one per holder) for hold times in one listing


@dataclass(frozen=True)
class Record:
    """One key of ``who()``: ``state`` HELD or WAIT; ``held`` how many slots of (name, max)
    are taken; ``rev`` the key's create_revision; ``lease`` hex. ``note`` says what is wrong
    with a key conch did not write (bad JSON, no lease, bad capacity), empty otherwise.

    Ages in whole seconds, by the reader's clock against ``started`` (None where unknown):
    ``queued_s`` since the key was written; ``waited_s`` how long it waited (a waiter: all of
    it; a holder that held from its key's creation: 0); ``held_s`` how long it has held (None
    for a waiter, and for a holder that waited first: etcd keeps no time for its promotion)."""

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
    queued_s: int | None = None
    waited_s: int | None = None
    held_s: int | None = None

    def to_text(self) -> str:
        """One line, fields in a fixed order; a field with spaces or unprintable characters
        (written by someone else) is shown JSON-quoted so it cannot forge another line."""
        line = (
            f"{self.name}[{self.held}/{'?' if self.max is None else self.max}] {self.state:<4}  "
            f"{_quoted(self.host)} pid={self.pid if self.pid is not None else '?'} "
            f"since={_quoted(self.started or '?')} rev={self.rev}"
        )
        line += f" note={self.note}" if self.note else ""
        if self.held_s is not None:
            return f"{line} held={_duration(self.held_s)}"
        if self.waited_s is not None:
            return f"{line} waited={_duration(self.waited_s)}"
        if self.queued_s is not None:  # a holder that waited first: its hold began unseen
            return f"{line} held=? queued={_duration(self.queued_s)}"
        return line

    def to_json(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "held" and (v or k != "note")}
        return json.dumps(fields, ensure_ascii=False)


def _quoted(text: str) -> str:
    return text if text.isprintable() and " " not in text else json.dumps(text, ensure_ascii=False)


def _duration(seconds: int) -> str:
    """Whole seconds, Go-style as conch's flags take them: ``45s``, ``3m12s``, ``2h0m5s``."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _age(started: str, now: float) -> int | None:
    """Whole seconds from ``started`` (UTC RFC 3339) to ``now`` (Unix time), at least 0;
    None if ``started`` is not such a time."""
    try:
        written = datetime.fromisoformat(started.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    # No zone: not the contract's UTC time, so no age.
    return None if written.tzinfo is None else max(0, int(now - written.timestamp()))


def _identity_fields(value: bytes) -> tuple[str, int | None, str, str, list[str]]:
    """host, pid, started, cmd, notes from a key's value; tolerant of anything."""
    try:
        data = json.loads(value)
        if not isinstance(data, dict):
            raise ValueError
    except (ValueError, RecursionError):
        return "?", None, "", "", ["malformed-value"]
    pid = data.get("pid")
    return (
        _as_text(data.get("host"), "?"),
        pid if type(pid) is int else None,
        _as_text(data.get("started"), ""),
        _as_text(data.get("cmd"), ""),
        [],
    )


def _as_text(value: object, missing: str) -> str:
    if value is None:
        return missing
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def who(client: Client, name: str, max_holders: int | None = None) -> list[Record]:
    """Every key under ``name`` (all capacities), in create_revision order per capacity; the
    capacity ``max_holders`` first when given. One KV.Range, then one per holder (at most
    HISTORY_READS) for its hold time; reads only (no lease). Raises UsageError for a bad
    ``max_holders``, EtcdError when etcd does not answer."""
    return drive(client, listing(name, max_holders))


def listing(
    name: str, max_holders: int | None = None
) -> Generator[codec.Call, rpc_pb2.RangeResponse, list[Record]]:
    """``who`` without its I/O, for both faces: yields each KV.Range, is sent its response
    (or thrown its error: Compacted for a hold time is an unknown one), returns the Records."""
    if max_holders is not None:
        keys.check_max(max_holders, "max_holders")
    now = time.time()
    request = kv.prefix_request(keys.name_prefix(name), sort_target=kv.CREATE, sort_order=kv.ASCEND)
    response = yield codec.Call("Range", request)
    groups: dict[int | None, list[Any]] = {}
    for item in response.kvs:
        groups.setdefault(keys.capacity_of(name, item.key), []).append(item)  # None: a bad key

    records = []
    reads_left = HISTORY_READS
    for capacity in sorted(groups, key=lambda c: (c is None or c != max_holders, c or 1 << 62)):
        items = groups[capacity]
        held = min(len(items), capacity) if capacity is not None else 0
        for rank, item in enumerate(items):
            host, pid, started, cmd, notes = _identity_fields(item.value)
            if capacity is None:
                notes.append("bad-key")
            if not item.lease:
                notes.append("no-lease")
            state = "HELD" if rank < held else "WAIT"
            rev = int(item.create_revision)
            from_creation = None
            if state == "HELD" and capacity is not None and reads_left > 0:
                reads_left -= 1
                # Fewer than ``capacity`` keys ahead of it when it was created: it held at once.
                sema = keys.sema_prefix(name, capacity)
                request = kv.prefix_request(
                    sema, revision=rev, limit=capacity, keys_only=True, max_create_revision=rev - 1
                )
                with contextlib.suppress(Compacted):  # unknown, then
                    history = yield codec.Call("Range", request)
                    from_creation = len(history.kvs) < capacity
            queued = _age(started, now)
            times: tuple[int | None, int | None, int | None] = (queued, queued, None)
            if queued is not None and state == "HELD":  # waited 0 and held all, or unknown
                times = (queued, 0, queued) if from_creation else (queued, None, None)
            fields = (host, pid, started, rev, f"{item.lease:x}", cmd, ",".join(notes))
            records.append(Record(name, capacity, held, state, *fields, *times))
    return records
