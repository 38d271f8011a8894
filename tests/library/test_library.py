"""The embedding API: the example service, coexistence with another etcd client's stubs."""

from __future__ import annotations

import array
import contextlib
import fcntl
import linecache
import logging
import os
import shutil
import signal
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conchpb.etcdserverpb import rpc_pb2

import conch
from conch import semaphore
from conch.etcd import Client, kv, lease
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag
from tests.conftest import (
    DEADLINE,
    alive,
    etcd_watchers,
    other_keys,
    poll,
    sema_keys,
)
from tests.delayproxy import FaultProxy, Seen, deletes, watch_created
from tests.etcd_server import EtcdCluster

ROOT = Path(__file__).resolve().parents[2]


def test_example_service_instances_never_overlap_and_tokens_rise(
    etcd: EtcdCluster, tmp_path: Path, name: str
) -> None:
    journal = tmp_path / "journal"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "guarded_service.py"),
        "--endpoints",
        etcd.endpoints,
        "--name",
        name,
        "--rounds",
        "3",
        "--journal",
        str(journal),
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(line.startswith("round token=") for o in outputs for line in o.splitlines()) == 6
    lines = [line.split() for line in journal.read_text().splitlines()]
    tokens = [int(fields[2].split("=")[1]) for fields in lines]
    # Rounds never interleave: the journal is 6 runs of 5 steps, tokens rising run by run.
    runs = [tokens[i : i + 5] for i in range(0, 30, 5)]
    assert len(lines) == 30 and all(len(set(run)) == 1 for run in runs)
    assert [run[0] for run in runs] == sorted({t for t in tokens})


def test_library_hold_reports_loss_by_flag_and_callback(client: Client, name: str) -> None:
    sema = conch.Semaphore(client, name, max=1, ttl=3)
    reasons: list[str] = []
    with pytest.raises(conch.HoldLost), sema.acquire(timeout=10) as hold:  # on leaving
        hold.on_lost(reasons.append)
        assert not hold.lost.is_set()
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(timeout=30)
        poll(lambda: reasons, what="the callback")
    assert sema_keys(client, name) == []


def test_library_nonblocking_acquire_raises_no_slot(client: Client, name: str) -> None:
    with conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10):
        with pytest.raises(conch.NoSlot):
            conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=0)
        assert [r.state for r in conch.who(client, name)] == ["HELD"]
    assert conch.who(client, name) == []


def test_a_second_release_returns_only_once_the_first_revoke_is_over(
    etcd: EtcdCluster, name: str
) -> None:
    """The supervisor's reaper thread releases as the child exits, and its main thread
    calls release() too: the second call must not return (and let the process exit)
    while the revoke is still on its way. The revoke may wait 60 s for the paused etcd, so
    that the 0.5 s looked at lies inside it however slowly this process is scheduled."""
    with etcd.client(request_timeout=60.0) as client:
        hold = conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10)
        second_done = threading.Event()
        first = threading.Thread(target=hold.release, daemon=True)

        def second_release() -> None:
            hold.release()
            second_done.set()

        second = threading.Thread(target=second_release, daemon=True)
        etcd.members[0].pause()
        try:
            first.start()
            poll(lambda: hold.expires_at() == 0.0, what="the first release under way")
            second.start()
            assert not second_done.wait(0.5), "release() returned while the revoke was pending"
        finally:
            etcd.members[0].resume()
        assert second_done.wait(DEADLINE)
        first.join(DEADLINE)
        assert sema_keys(client, name) == []


@pytest.mark.parametrize("order", ["theirs-first", "ours-first"])
def test_coexists_with_another_etcd_clients_stubs(etcd: EtcdCluster, order: str) -> None:
    pytest.importorskip("pyetcd")
    ours = "import conch.etcd.kv as kv; from conch.etcd.client import connect"
    theirs = "import pyetcd"
    imports = [theirs, ours] if order == "theirs-first" else [ours, theirs]
    host, port = etcd.members[0].endpoint.split(":")
    script = textwrap.dedent(f"""
        {imports[0]}
        {imports[1]}
        with connect({etcd.endpoints!r}) as c:
            kv.put(c, b"/coexist/{order}", b"ours")
        other = pyetcd.client(host={host!r}, port={port})
        value, _ = other.get("/coexist/{order}")
        assert value == b"ours", value
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _acquire_in_thread(
    sema: conch.Semaphore, timeout: float, guard: bool = True, thread_name: str | None = None
) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["hold"] = sema.acquire(timeout=timeout, guard=guard)
        except conch.ConchError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    return thread, result


def _idle(thread_name: str, boxes: list[Any]) -> bool:
    """The thread named ``thread_name`` is blocked on its acquire's mailbox (in
    ``_act``), and nothing is in ``boxes``: it has made every request its last input
    called for and makes none until the next one comes. Under a loaded machine a waiter can
    still be on its way there (a gap check after its watch was confirmed) when the events a
    test waits for have all happened."""
    idents = [t.ident for t in threading.enumerate() if t.name == thread_name]
    if len(idents) != 1 or idents[0] is None:
        return False
    frame = sys._current_frames().get(idents[0])
    return (
        frame is not None
        and frame.f_code.co_name == "_act"
        and "box.get(" in (linecache.getline(frame.f_code.co_filename, frame.f_lineno))
        and all(box.empty() for box in boxes)
    )


def _two_waiters(
    client: Client, name: str, sema: conch.Semaphore
) -> tuple[threading.Thread, dict[str, object], threading.Thread, dict[str, object]]:
    """A first and then a second waiter queued behind the holder of ``sema``, each seen in
    etcd before the next starts: (first thread, its result, second thread, its result)."""
    first, first_result = _acquire_in_thread(sema, 30, thread_name="first")
    poll(lambda: len(sema_keys(client, name)) == 2, what="the first waiter queued")
    second, second_result = _acquire_in_thread(sema, 30, thread_name="second")
    poll(lambda: len(sema_keys(client, name)) == 3, what="the second waiter queued")
    return first, first_result, second, second_result


def _handed_over(
    holder: conch.Hold, thread: threading.Thread, result: dict[str, object]
) -> conch.Hold:
    """Release ``holder``; return the Hold the waiter in ``thread`` gets."""
    holder.release()
    thread.join(DEADLINE)
    hold = result.get("hold")
    assert isinstance(hold, conch.Hold), result
    return hold


def _asked_after_deletion(proxy: FaultProxy, key: bytes, watched: list[bytes]) -> list[Seen]:
    """The reads, writes and new watches the client on ``proxy`` sent once the proxy had
    passed on the deletion of ``key`` to it. A gap check of the ``watched`` keys (the answer
    to its window watch's confirmation, on its way when the deletion came) is not among
    them: the waiter holds on the deletion once that check says nothing changed before."""
    seen = list(proxy.seen)
    at = next(i for i, s in enumerate(seen) if deletes(s, key))
    return [
        s
        for s in seen[at + 1 :]
        if s.sent
        and s.method in ("Range", "Txn", "Watch")
        and not (s.method == "Watch" and not s.message.HasField("create_request"))
        and not _gap_check(s, watched)
    ]


def _gap_check(seen: Seen, watched: list[bytes]) -> bool:
    """``seen`` reads some of ``watched`` one key each (a Range, or a read-only Txn)."""
    ranges = [seen.message] if seen.method == "Range" else []
    if seen.method == "Txn" and not seen.message.compare:
        ranges = [op.request_range for op in seen.message.success]
        if not all(op.HasField("request_range") for op in seen.message.success):
            return False
    return bool(ranges) and all(not r.range_end and r.key in watched for r in ranges)


def _queued_behind(client: Client, name: str, count: int) -> list[bytes]:
    """The keys of the semaphore once ``count`` are in it, oldest first."""
    poll(lambda: len(sema_keys(client, name)) == count, what=f"{count} keys queued")
    return [k.key for k in sema_keys(client, name)]


def _touched_and_watching(
    client: Client, name: str, max_holders: int, *proxies: FaultProxy
) -> None:
    """Every waiter's key was touched (re-put) while waiting, and etcd confirmed the watch on
    the deletions under the prefix of each waiter whose client goes through ``proxies``."""
    poll(
        lambda: all(
            k.mod_revision > k.create_revision for k in sema_keys(client, name)[max_holders:]
        ),
        what="every waiter's touch",
    )
    for proxy in proxies:
        poll(lambda p=proxy: watch_created(p.seen), what="a waiter in the window")  # type: ignore[misc]


def test_first_waiter_whose_key_was_deleted_does_not_take_the_freed_slot_with_it(
    client: Client, name: str
) -> None:
    """The first waiter holds on a deletion ahead of it only if its own key is still there
    (both come on one watch, in revision order). Its key deleted by hand, then the holder's
    release: it must not report a hold on the deleted key, but re-enter with a new one."""
    holder = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    thread, result = _acquire_in_thread(conch.Semaphore(client, name, max=1, ttl=5), 30)
    poll(lambda: len(sema_keys(client, name)) == 2, what="the waiter queued")
    waiter_key = sema_keys(client, name)[1]
    kv.txn(client, [], [kv.op_delete(waiter_key.key)], [])
    holder.release()
    thread.join(30)
    hold = result.get("hold")
    assert isinstance(hold, conch.Hold), result
    assert hold.revision > waiter_key.create_revision
    assert [k.create_revision for k in sema_keys(client, name)] == [hold.revision]
    hold.release()
    assert sema_keys(client, name) == []


def test_first_waiter_ignores_deletions_behind_it(client: Client, name: str) -> None:
    """The first waiter watches every deletion under the prefix; one behind it (a later
    waiter giving up) must not make it take a slot that is still held."""
    holder = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    thread, result = _acquire_in_thread(conch.Semaphore(client, name, max=1, ttl=5), 30)
    poll(lambda: len(sema_keys(client, name)) == 2, what="the first waiter queued")
    with pytest.raises(conch.NoSlot):
        conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=1.0)
    thread.join(1.0)  # an observation window: the first waiter must still be waiting
    assert thread.is_alive() and not result
    holder.release()
    thread.join(30)
    hold = result.get("hold")
    assert isinstance(hold, conch.Hold), result
    hold.release()


@pytest.mark.alone
def test_at_max_1_the_waiter_behind_a_new_holder_moves_up_and_takes_the_slot_with_no_request(
    client: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter behind a new holder has moved up while the job runs (it is in the window:
    it watches the deletions under the prefix, the new holder's key was touched while it
    waited); the holder's release then hands it the slot straight from the deletion event,
    with no request on the way."""
    requests: Counter[str] = Counter()
    moved_up = threading.Event()
    boxes: list[Any] = []
    real_range, real_txn, real_watch = kv.range_, kv.txn, Watch

    def range_(*args: Any, **kwargs: Any) -> Any:
        requests[threading.current_thread().name] += 1
        return real_range(*args, **kwargs)

    def txn(*args: Any, **kwargs: Any) -> Any:
        requests[threading.current_thread().name] += 1
        return real_txn(*args, **kwargs)

    def watch(client: Client, key: bytes, start: int, deliver: Any, **kwargs: Any) -> Watch:
        if threading.current_thread().name == "second" and kwargs.get("range_end"):
            inner = deliver
            boxes.append(inner.func.__self__.box)

            def deliver(notice: WatchNotice) -> None:
                inner(notice)
                if notice.created:  # first in line: watching the deletions ahead of it
                    moved_up.set()

        return real_watch(client, key, start, deliver, **kwargs)

    monkeypatch.setattr(kv, "range_", range_)
    monkeypatch.setattr(kv, "txn", txn)
    monkeypatch.setattr(semaphore, "Watch", watch)
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    holder = sema.acquire(timeout=10)
    first, first_result, second, second_result = _two_waiters(client, name, sema)
    new_holder = _handed_over(holder, first, first_result)
    try:
        key = poll(
            lambda: next(k for k in sema_keys(client, name) if k.key == new_holder.key),
            what="the new holder's key",
        )
        poll(
            lambda: kv.get(client, key.key).mod_revision > key.create_revision,  # type: ignore[union-attr]
            what="the new holder's touch",
        )
        assert moved_up.wait(DEADLINE), "the waiter behind did not move up"
        poll(lambda: _idle("second", boxes), what="the waiter done with its gap check")
        before = requests["second"]
        hold = _handed_over(new_holder, second, second_result)
        assert requests["second"] == before, "the waiter read etcd between release and hold"
        hold.release()
    finally:
        new_holder.release()
    assert sema_keys(client, name) == []


def test_a_short_job_hands_over_from_the_release_event_to_the_waiter_behind_it(
    client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """At max 1, H holds and W1, W2 wait. W1 gets the slot and releases it as soon as W2 has
    moved up (W2's own touch: far shorter than the new holder's old touch delay): W2 holds
    straight from W1's deletion event, with no read or new watch on the way. Before, W2
    watched W1 alone and moved up only on W1's touch, half a second into W1's hold: after a
    shorter job it woke on the deletion and read the queue first."""
    proxy = proxies()
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    holder = sema.acquire(timeout=10)
    with proxy.client() as own:
        first, first_result = _acquire_in_thread(sema, 30)
        _queued_behind(client, name, 2)
        second, second_result = _acquire_in_thread(
            conch.Semaphore(own, name, max=1, ttl=5), 30, guard=False
        )
        queue = _queued_behind(client, name, 3)
        new_holder = _handed_over(holder, first, first_result)
        try:
            _touched_and_watching(client, name, 1, proxy)
            hold = _handed_over(new_holder, second, second_result)
            asked = _asked_after_deletion(proxy, new_holder.key, queue[1:])
            assert asked == [], f"the waiter asked etcd between release and hold: {asked}"
            hold.release()
        finally:
            new_holder.release()
    assert sema_keys(client, name) == []


def test_at_max_2_out_of_order_releases_hand_over_with_no_read_and_no_write_by_the_new_holder(
    client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """At max 2, A and B hold, C and D wait; B leaves, then A. C and D each hold straight
    from a deletion event, with no read or new watch on the way, and no new holder writes
    anything (its guard makes no touch: the waiters touched while they waited). Before, a
    new holder at max > 1 touched its key at once, competing with the next handoff, and D
    woke on C's touch to read the queue. C's and D's clients go through proxies of their
    own, which count what each asked of etcd."""
    sema = conch.Semaphore(client, name, max=2, ttl=5)
    a, b = sema.acquire(timeout=10), sema.acquire(timeout=10)
    c_proxy, d_proxy = proxies(), proxies()
    with c_proxy.client() as c_client, d_proxy.client() as d_client:
        c, c_result = _acquire_in_thread(conch.Semaphore(c_client, name, 2, ttl=5), 30, False)
        _queued_behind(client, name, 3)
        d, d_result = _acquire_in_thread(conch.Semaphore(d_client, name, 2, ttl=5), 30, False)
        queue = _queued_behind(client, name, 4)
        _touched_and_watching(client, name, 2, c_proxy, d_proxy)
        holds = [_handed_over(b, c, c_result), _handed_over(a, d, d_result)]
        asked = [
            *_asked_after_deletion(c_proxy, b.key, queue[:3]),
            *_asked_after_deletion(d_proxy, a.key, queue),
        ]
        assert asked == [], f"a waiter asked etcd on the way: {asked}"
        guarded = [len(p.seen) for p in (c_proxy, d_proxy)]
        for hold in holds:
            hold.start_guard()
        for hold in holds:
            hold.release()
        writes = [
            p.requests("Txn", since=at) for p, at in zip((c_proxy, d_proxy), guarded, strict=True)
        ]
        assert writes == [[], []], f"a new holder wrote: {writes}"
    assert sema_keys(client, name) == []


@pytest.mark.alone
def test_a_key_deleted_early_in_a_hold_that_waited_is_noticed_within_a_fraction_of_a_second(
    client: Client, name: str
) -> None:
    """The hold's own watch opens GUARD_WATCH_DELAY into the hold, whatever the max-1 touch
    waits for (TOUCH_DELAY): a deletion from outside 0.1 s in is noticed at once, not when
    the touch is due (a child would run beside the next holder for 0.4 s more)."""
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    first = sema.acquire(timeout=10)
    thread, result = _acquire_in_thread(sema, 30)
    poll(lambda: len(sema_keys(client, name)) == 2, what="the waiter queued")
    hold = _handed_over(first, thread, result)
    try:
        time.sleep(0.1)  # where in the hold the fault lands, not a synchronisation
        kv.delete(client, hold.key)
        deleted = time.monotonic()
        assert hold.lost.wait(DEADLINE)
        assert time.monotonic() - deleted < 0.3, "the deletion was noticed late"
    finally:
        hold.release()


def test_a_spread_waiter_of_a_busy_host_leaves_no_watch_open_behind_it(
    own_etcd: EtcdCluster, name: str
) -> None:
    """--spread: a waiter whose host holds the key already waits for that key to change;
    the watch that woke it is closed before it tries again (it stayed open, one more per
    wake, for as long as the client lived: a long-running service leaked streams). The
    holder's key is re-put three times (three wakes, each found busy again): etcd still
    counts two watches (the holder's and the waiter's one), not one more per wake. The
    watches counted are etcd's own (its watcher metric), on an etcd of this test's own; the
    waiter's client goes through a proxy, which shows each of its new watches confirmed."""
    identity = conch.Identity.current(["job"], host="h1")
    proxy = FaultProxy(own_etcd.members[0].endpoint)
    with own_etcd.client() as client, proxy.client() as own:
        holder = conch.Semaphore(client, name, 1, ttl=5, spread=True, identity=identity)
        waiter = conch.Semaphore(own, name, 1, ttl=5, spread=True, identity=identity)
        hold = holder.acquire(timeout=10)
        held = kv.get(client, hold.key)
        assert held is not None
        thread, result = _acquire_in_thread(waiter, 30)
        poll(
            lambda: etcd_watchers(own_etcd) == 2 and _watches_confirmed(proxy) == 1,
            what="the holder's and the busy waiter's watches",
        )
        for wake in range(1, 4):  # a change of the busy key: the waiter wakes, reads, waits
            kv.put(client, hold.key, held.value, lease=hold.lease_id)
            poll(
                lambda w=wake: _watches_confirmed(proxy) == w + 1,  # type: ignore[misc]
                what=f"the waiter's watch after {wake} wakes",
            )
            assert etcd_watchers(own_etcd) == 2, f"after {wake} wakes"
        _handed_over(hold, thread, result).release()
        poll(lambda: etcd_watchers(own_etcd) == 0, timeout=5, what="every watch closed")
    proxy.close()


def _watches_confirmed(proxy: FaultProxy) -> int:
    return sum(not s.sent and s.method == "Watch" and s.message.created for s in proxy.seen)


def test_a_hold_after_a_long_wait_watches_its_key_from_where_it_took_the_slot(
    client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """The hold's own watch starts at the revision where the key was seen holding, not at
    the key's create_revision: after a long wait on a busy cluster etcd would replay all the
    history in between to that watch, or refuse it as compacted (here: compacted past it).
    The waiter's client goes through a proxy, which shows the watches it asks for."""
    proxy = proxies()
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    holder = sema.acquire(timeout=10)
    with proxy.client() as own:
        thread, result = _acquire_in_thread(conch.Semaphore(own, name, max=1, ttl=5), 30)
        queued = poll(lambda: sema_keys(client, name)[1:], what="the waiter queued")[0]
        for i in range(3):
            kv.put(client, f"/churn/{name}/{i}".encode(), b"x")
        compacted = kv.put(client, f"/churn/{name}/last".encode(), b"x").header.revision
        client.call("kv", "Compact", rpc_pb2.CompactionRequest(revision=compacted))
        hold = _handed_over(holder, thread, result)
        try:
            starts = poll(
                lambda: [
                    r.create_request.start_revision
                    for r in proxy.requests("Watch")
                    if r.create_request.key == hold.key and not r.create_request.range_end
                ],
                what="the hold's own watch",
            )
            assert starts[0] > compacted > queued.create_revision
            assert not hold.lost.is_set()
        finally:
            hold.release()


ADOPTING_EMBEDDER = """
import sys
import conch
from conch.flag import Flag
from conch.supervisor import adopt_orphans, supervise

assert adopt_orphans() and adopt_orphans()  # idempotent
with conch.connect(sys.argv[1]) as client:
    sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=10)
    for code in (0, 3, 5, 7, 9):
        cmd = ["sh", "-c", f"(sleep 0 &); exit {code}"]
        print(supervise(sema, cmd, None, 2.0, Flag("stop")), flush=True)
"""


def test_an_adopting_embedder_gets_every_childs_status_run_after_run(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """After adopt_orphans(), one process-wide thread reaps every child: a later run's child
    is not reaped (and its status dropped) by what an earlier run left behind."""
    assert run_script(ADOPTING_EMBEDDER, etcd, name) == ["0", "3", "5", "7", "9"]
    assert sema_keys(client, name) == []


def run_script(script: str, etcd: EtcdCluster, name: str) -> list[str]:
    """The words ``script`` prints, run by a Python of its own with etcd's endpoints and
    ``name`` as its arguments; it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", script, etcd.endpoints, name],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


IGNORING_SIGCHLD = """
import signal, sys
import conch
from conch.flag import Flag
from conch.supervisor import adopt_orphans, supervise

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children itself
if sys.argv[3] == "adopting":
    assert adopt_orphans()
with conch.connect(sys.argv[1]) as client:
    sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=10)
    for _ in range(2):
        print(supervise(sema, ["sh", "-c", "exit 0"], None, 2.0, Flag("stop")), flush=True)
"""


@pytest.mark.parametrize("mode", ["plain", "adopting"])
def test_an_embedder_that_ignores_sigchld_gets_its_slot_back_when_the_child_ends(
    etcd: EtcdCluster, client: Client, name: str, mode: str
) -> None:
    """With SIGCHLD ignored the kernel reaps children at once and waitpid() fails with
    ECHILD: the child's end must still end the run (status 0, as subprocess reports it),
    not leave the slot held by a supervisor that waits forever."""
    out = subprocess.run(
        [sys.executable, "-c", IGNORING_SIGCHLD, etcd.endpoints, name, mode],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0"]
    assert sema_keys(client, name) == []


def test_a_hold_is_lost_with_its_session_even_while_its_guard_waits_on_etcd(
    client: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard thread can sit in a call to etcd for seconds (its touch, a Range) while
    etcd hangs; the session's loss must reach ``hold.lost`` at once all the same. Here the
    guard's touch is held back in the client, and the lease revoked from outside."""
    in_touch, let_go = threading.Event(), threading.Event()
    real_txn = kv.txn

    def txn(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "conch-timer":
            in_touch.set()
            let_go.wait(DEADLINE)
        return real_txn(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kv, "txn", txn)
    first = conch.Semaphore(client, name, 2, ttl=3).acquire(timeout=10)
    second = conch.Semaphore(client, name, 2, ttl=3).acquire(timeout=10)
    holds: list[conch.Hold] = []
    waiter = threading.Thread(
        target=lambda: holds.append(conch.Semaphore(client, name, 2, ttl=3).acquire(timeout=30))
    )
    try:
        # The third waits behind three other keys and holds on the look the last one's
        # deletion wakes it to: its hold's guard owes the touch it never made while waiting.
        with other_keys(client, name, 2, 3) as others:
            waiter.start()
            poll(lambda: len(sema_keys(client, name, 2)) == 6, what="third queued")
            for key in others[:2]:
                kv.delete(client, key)
            first.release()
            kv.delete(client, others[2])
            waiter.join(DEADLINE)
        (third,) = holds
        assert in_touch.wait(DEADLINE)
        lease.revoke(client, third.lease_id)
        assert third.session.lost.wait(DEADLINE)
        assert third.lost.wait(1.0), "hold.lost waited for the guard"
        assert str(third.lost.reason).startswith("session lost")
    finally:
        let_go.set()
        if waiter.ident is not None:
            waiter.join(DEADLINE)
        for hold in (second, *holds):
            hold.release()


def test_who_shows_odd_values_as_text_and_capacities_out_of_range_as_bad_keys(
    client: Client, name: str
) -> None:
    base = f"/conch/v1/sema/{name}/".encode()
    kv.put(client, base + b"99999999999999999999999/x", b"{}")
    kv.put(client, base + b"1/y", b'{"pid": true, "host": {"x": 1}, "started": null}')
    try:
        records = conch.who(client, name)
        (big,) = [r for r in records if r.max is None]
        assert "bad-key" in big.note and big.state == "WAIT"
        (odd,) = [r for r in records if r.max == 1]
        assert (odd.pid, odd.host, odd.started) == (None, '{"x": 1}', "")
        assert "since=?" in odd.to_text() and "pid=?" in odd.to_text()
    finally:
        kv.delete(client, base, kv.prefix_end(base))


def test_a_key_says_when_it_was_written_not_when_its_semaphore_was_made(
    client: Client, name: str
) -> None:
    sema = conch.Semaphore(
        client, name, 1, identity=conch.Identity("h", 1, "2001-01-01T00:00:00Z", "job")
    )
    with sema.acquire(timeout=10):
        (record,) = conch.who(client, name)
        written = datetime.strptime(record.started, "%Y-%m-%dT%H:%M:%SZ")
        assert abs(datetime.utcnow() - written) < timedelta(minutes=5)
        assert (record.host, record.pid, record.cmd) == ("h", 1, "job")


def test_calls_racing_the_clients_close_raise_conch_errors_only(etcd: EtcdCluster) -> None:
    endpoints = [conch.Endpoint.parse(e) for e in etcd.endpoints.split(",")]
    errors: list[BaseException] = []

    def call_until_it_fails(client: Client, answered: threading.Semaphore, watch: bool) -> None:
        first = True
        while True:
            try:
                if watch:  # a stream: opening one races the close as a unary call does
                    Watch(client, b"/race", 0, lambda notice: None).cancel()
                kv.get(client, b"/race")
            except BaseException as exc:
                errors.append(exc)
                return
            if first:
                answered.release()
                first = False

    for _ in range(10):
        client, answered = Client.connect(endpoints), threading.Semaphore(0)
        threads = [
            threading.Thread(target=call_until_it_fails, args=(client, answered, i % 2 == 0))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for _ in threads:  # every thread is calling: the close lands mid-call somewhere
            assert answered.acquire(timeout=DEADLINE)
        client.close()
        for t in threads:
            t.join(DEADLINE)
    assert len(errors) == 80
    assert all(isinstance(e, conch.EtcdError) for e in errors), {type(e) for e in errors}


LIBRARY_LOGGING = """
import logging, sys
import conch
with conch.connect(sys.argv[1]) as client:
    sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=5)
    sema.acquire(timeout=10).release()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    sema.acquire(timeout=10).release()
"""


def test_the_library_logs_through_the_standard_logging_module(etcd: EtcdCluster, name: str) -> None:
    """A service that embeds conch routes its lines with its own logs (logger ``conch``):
    nothing on stderr before it sets logging up, INFO lines after."""
    run = subprocess.run(
        [sys.executable, "-c", LIBRARY_LOGGING, etcd.endpoints, name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines and all(line.startswith("conch INFO conch: event=") for line in lines), lines
    assert [line.split()[3] for line in lines] == [
        "event=session",
        "event=acquired",
        "event=released",
    ]


def test_no_child_starts_when_the_watchdog_cannot(
    client: Client, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog's interpreter exits at once (an upgrade in progress, a broken package):
    the child must not start without it; the slot is given back."""
    from conch.flag import Flag
    from conch.supervisor import supervise

    # The interpreter the watchdog is started with: one that exits at once.
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    marker = tmp_path / "ran"
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    code = supervise(sema, ["touch", str(marker)], None, 1.0, Flag("stop"))
    assert code == 70
    assert not marker.exists()
    assert sema_keys(client, name) == []


def test_an_error_inside_the_supervision_kills_the_child_before_the_slot_goes(
    client: Client, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: whatever escapes run_child (here an error while stopping the child on a
    signal) must not leave the child running, unwatched, while the slot is released."""
    from conch import supervisor
    from conch.flag import Flag
    from conch.watchdog import Watchdog

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the termination")

    monkeypatch.setattr(Watchdog, "stand_by", broken)  # the termination's first step
    pidfile = tmp_path / "pid"
    stop = Flag("stop")
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    result: dict[str, object] = {}

    def run() -> None:
        try:
            supervisor.supervise(
                sema, ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"], None, 1.0, stop
            )
        except RuntimeError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    pid = int(poll(lambda: pidfile.exists() and pidfile.read_text().strip(), what="child up"))
    stop.set(15)
    thread.join(DEADLINE)
    assert "error" in result
    poll(lambda: not alive(pid), what="the child killed")
    assert sema_keys(client, name) == []


def test_a_logging_handler_that_raises_does_not_break_the_hold(client: Client, name: str) -> None:
    """The embedder's logging is not ours to trust: a handler that raises on every record
    must neither fail acquire() nor kill the thread that notices a lost lease."""
    import logging

    class Raising(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("broken handler")

    logger = logging.getLogger("conch")
    handler, level = Raising(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        hold = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(DEADLINE), "the loss went unnoticed"
        hold.release()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_no_child_starts_on_a_hold_lost_while_the_watchdog_was_starting(
    client: Client, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a loaded machine the watchdog's start can take seconds after the slot came; the
    hold is checked again after it, right before the child."""
    from conch.errors import HoldLost
    from conch.flag import Flag
    from conch.supervisor import run_child
    from conch.watchdog import Watchdog

    hold = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)

    class SlowStart(Watchdog):
        def handshake(self, timeout: float, stop: Flag) -> str | None:
            lease.revoke(client, hold.lease_id)  # the hold goes while we wait
            hold.lost.wait(DEADLINE)
            return super().handshake(timeout, stop)

    caplog.set_level(logging.INFO, logger="conch")
    marker = tmp_path / "ran"
    watchdog = SlowStart()
    with pytest.raises(HoldLost):
        run_child(hold, ["touch", str(marker)], 1.0, Flag("stop"), watchdog)
    assert "event=child-start" not in caplog.text and not marker.exists()
    hold.release()


def test_a_watchdog_that_died_while_conch_queued_is_not_ready() -> None:
    from conch.flag import Flag
    from conch.watchdog import Watchdog

    watchdog = Watchdog()
    poll(lambda: _unread(watchdog.pid), what="the watchdog said it runs")
    os.kill(watchdog.pid, signal.SIGKILL)
    poll(lambda: watchdog.ended, what="the watchdog gone")
    assert watchdog.handshake(0, Flag("stop")) == "the watchdog exited before the child"


def _unread(pid: int) -> int:
    """The bytes child ``pid`` wrote to its stdout that this process has not read yet (its
    stdout a pipe to us): FIONREAD on our end of that pipe."""
    pipe = os.readlink(f"/proc/{pid}/fd/1")
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == pipe:
                count = array.array("i", [0])
                fcntl.ioctl(int(fd), termios.FIONREAD, count)
                if count[0]:
                    return count[0]
    return 0


def test_the_handshake_sends_the_watchdog_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the child, whether the watchdog can run is read in /proc, not asked: a probe's
    answer was a round trip to another process on the handoff's path (1-7 ms, loaded)."""
    from conch.flag import Flag
    from conch.watchdog import Watchdog

    watchdog = Watchdog()
    # What this process writes into the watchdog's stdin (the pipe /proc shows as its fd 0).
    pipe = os.readlink(f"/proc/{watchdog.pid}/fd/0")
    ours = {int(fd) for fd in os.listdir("/proc/self/fd") if _links_to(int(fd), pipe)}
    sent: list[bytes] = []
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if fd in ours:
            sent.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    assert watchdog.handshake(DEADLINE, Flag("stop")) is None
    assert sent == []
    assert watchdog.close(DEADLINE)


def _links_to(fd: int, target: str) -> bool:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}") == target
    return False


def test_a_stop_while_the_watchdog_starts_withdraws_and_no_child_starts(
    client: Client, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal (stop) while run_child waits for a slow watchdog: Interrupted, as when still
    queued, and no child. It used to wait the watchdog out and start the child anyway."""
    from conch import supervisor
    from conch.errors import Interrupted
    from conch.flag import Flag
    from conch.watchdog import Watchdog

    stop = Flag("stop")

    class SlowStart(Watchdog):
        def handshake(self, timeout: float, stop_flag: Flag) -> str | None:
            stop.set(15)  # the signal comes while the watchdog is still starting
            return super().handshake(timeout, stop_flag)

    monkeypatch.setattr(supervisor, "Watchdog", SlowStart)
    marker = tmp_path / "ran"
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    with pytest.raises(Interrupted):
        supervisor.supervise(sema, ["touch", str(marker)], None, 1.0, stop)
    assert not marker.exists()
    assert sema_keys(client, name) == []


def test_an_embedders_own_lc_ctype_reaches_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the command undoes Python's locale coercion; a service's LC_CTYPE is its own."""
    from types import SimpleNamespace

    from conch.supervisor import child_env

    monkeypatch.setenv("LC_CTYPE", "C.UTF-8")
    hold = SimpleNamespace(name="n", revision=7, lease_id=255, max=1)
    assert child_env(hold)["LC_CTYPE"] == "C.UTF-8"  # type: ignore[arg-type]


NO_REAPING_THREAD = """
import os, sys, threading, time
import conch
from conch.flag import Flag
from conch.supervisor import supervise

children = []
real_start = threading.Thread.start


def start(thread):
    # The thread that waits for the child: the only process of ours running sleep.
    if thread.name == "conch-reap":
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if ppid == os.getpid() and cmdline.read().startswith(b"sleep"):
                        children.append(int(entry))
            except OSError:
                pass
        if children:
            raise RuntimeError("can't start new thread")
    real_start(thread)


threading.Thread.start = start
with conch.connect(sys.argv[1]) as client:
    sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=5)
    try:
        supervise(sema, ["sleep", "60"], None, 1.0, Flag("stop"))
    except RuntimeError:
        # Our child killed: a zombie of ours (we do not reap it) within a deadline.
        deadline = time.monotonic() + 10
        state = ""
        while state != "Z" and time.monotonic() < deadline:
            with open(f"/proc/{children[0]}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
            time.sleep(0.02)  # a poll's interval
        print(len(children), state, flush=True)
"""


def test_no_reaping_thread_for_the_child_kills_it_before_the_slot_goes(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """Thread.start fails for the child's reaper (a pids limit the child itself just
    reached): the child must not run on, unreaped and unwatched, while the slot is released.
    In a process of its own: one that adopts orphans (a test before in this worker may have
    made it so) reaps with a thread started once, before any child."""
    assert run_script(NO_REAPING_THREAD, etcd, name) == ["1", "Z"]
    assert sema_keys(client, name) == []


def test_supervise_works_with_more_than_1024_descriptors_open(client: Client, name: str) -> None:
    """select() refuses descriptors past 1023; a busy service holds that many."""
    import resource

    from conch.flag import Flag
    from conch.supervisor import supervise

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        sema = conch.Semaphore(client, name, max=1, ttl=5)
        assert supervise(sema, ["sh", "-c", "exit 3"], None, 1.0, Flag("stop")) == 3
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_lease_gone_before_the_first_write_re_enters(
    client: Client, name: str, proxies: Callable[[], FaultProxy]
) -> None:
    """A process stopped between its LeaseGrant and its first write finds its lease expired:
    etcd refuses the put (lease not found). That is a lost session: re-enter, not give up.
    The proxy the waiter's client goes through revokes the lease its first Txn puts on."""
    proxy = proxies()

    def expired_first(request: rpc_pb2.TxnRequest, context: object) -> None:
        leases = [op.request_put.lease for op in request.success if op.HasField("request_put")]
        lease.revoke(client, leases[0])

    proxy.before("Txn", expired_first, times=1)
    with proxy.client() as own:
        hold = conch.Semaphore(own, name, max=1, ttl=5).acquire(timeout=20)
        assert len(proxy.requests("LeaseGrant")) == 2
        hold.release()
