"""--who's times: how long each holder has held and each waiter has waited."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import conch
from conch.etcd import kv
from conch.etcd.client import Client
from tests.conftest import Gate, Runner, poll, sema_keys, who_json


def _ago(seconds: float) -> str:
    when = datetime.now(UTC) - timedelta(seconds=seconds)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _value(started: str) -> bytes:
    return f'{{"host":"h","pid":1,"started":"{started}","cmd":"job"}}'.encode()


def test_who_tells_held_and_waited_times_and_a_holder_that_waited_apart_by_etcd_history(
    client: Client, name: str
) -> None:
    base = f"/conch/v1/sema/{name}/2/".encode()
    kv.put(client, base + b"a", _value(_ago(100)))  # held from its creation
    kv.put(client, base + b"x", _value(_ago(300)))
    kv.put(client, base + b"y", _value(_ago(300)))
    kv.put(client, base + b"b", _value(_ago(200)))  # two keys ahead of it: it waited first,
    kv.delete(client, base + b"x")  # then holds
    kv.delete(client, base + b"y")
    kv.put(client, base + b"a", _value(_ago(100)))  # a re-put changes nothing: held from creation
    kv.put(client, base + b"c", _value(_ago(30)))  # waits
    kv.put(client, base + b"d", _value(_ago(-3600)))  # its writer's clock is an hour ahead
    kv.put(client, base + b"e", b'{"started":"yesterday"}')
    try:
        a, b, c, d, e = conch.who(client, name)
        assert (a.state, b.state, c.state) == ("HELD", "HELD", "WAIT")
        # the listing is read at most a few seconds after the puts
        assert a.held_s is not None and 100 <= a.held_s <= 110
        assert (a.waited_s, a.queued_s) == (0, a.held_s)
        assert "held=1m4" in a.to_text() and "waited=" not in a.to_text()
        assert (b.held_s, b.waited_s) == (None, None)
        assert b.queued_s is not None and 200 <= b.queued_s <= 210
        assert " held=? queued=3m2" in b.to_text()
        assert c.held_s is None and c.waited_s is not None and 30 <= c.waited_s <= 40
        assert c.queued_s == c.waited_s and " waited=3" in c.to_text()
        assert (d.waited_s, d.queued_s) == (0, 0) and d.to_text().endswith(" waited=0s")
        assert (e.queued_s, e.waited_s, e.held_s) == (None, None, None)
        assert "held=" not in e.to_text() and "waited=" not in e.to_text()
    finally:
        kv.delete(client, base, kv.prefix_end(base))


def test_who_shows_the_times_of_running_conchs_in_text_and_json(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="the holder's child")
    waiter = conch.start("sema", name, "--max", "1", "--", *gate.cmd("w"))
    poll(lambda: len(sema_keys(client, name, 1)) == 2, what="the waiter queued")

    def aged() -> list[dict[str, object]]:
        records = who_json(conch, name)
        return records if records[1]["waited_s"] >= 2 else []  # type: ignore[operator]

    h, w = poll(aged, what="the waiter to have waited 2 s")
    keys = list(h)
    assert keys[:9] == ["name", "max", "state", "host", "pid", "started", "rev", "lease", "cmd"]
    assert keys[9:] == ["queued_s", "waited_s", "held_s"]
    assert (h["state"], w["state"]) == ("HELD", "WAIT")
    assert h["waited_s"] == 0 and w["held_s"] is None
    assert h["held_s"] >= w["waited_s"]  # type: ignore[operator]
    assert h["held_s"] < 60  # type: ignore[operator]
    code, out, _ = conch.run("sema", name, "--who")
    held_line, wait_line = out.splitlines()
    assert code == 0 and " held=" in held_line and " waited=" in wait_line

    gate.release("h")
    poll(lambda: gate.now_running() == {"w"}, what="the waiter's child")
    # The waiter got its slot at a deletion etcd keeps no time for: etcd's history shows it
    # had a key ahead of it when it queued, so its hold reads as unknown, bounded by the
    # time since it queued.
    (promoted,) = who_json(conch, name)
    assert promoted["state"] == "HELD" and promoted["waited_s"] is None
    assert promoted["queued_s"] >= 2  # type: ignore[operator]
    code, out, _ = conch.run("sema", name, "--who")
    assert " held=? queued=" in out
    gate.release("w")
    assert holder.wait() == 0 and waiter.wait() == 0
