"""A brief etcd outage costs no place and stops no child early: one etcd 3.5.1 (or 3.4)
SIGKILLed and started again on its data 3 s later, `--ttl 10s`, a holder and three
waiters, through the command and through both library faces.

etcd restarts every lease's countdown when it comes back (a new leader), so the leases
outlive a 3 s outage. The loss rule (``conch.core.session``): a waiter's session is lost
only when etcd says its lease is gone, so the waiters keep their keys, their
create_revisions and their order; a holder's child is stopped only by its deadline (the
SIGTERM planned back from the lease's earliest expiry E) or when etcd says the lease or key
is gone, never because a keepalive was late. Each run prints when the SIGTERM (or the
library hold's loss) came against E.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conch.core.loss import Loss, LossReason
from conch.etcd import Client, kv
from conch.etcd.endpoints import Endpoint
from conch.etcd.status import server_version
from conch.flag import Flag
from conch.semaphore import Semaphore
from conch.supervisor import supervise
from tests.conftest import DEADLINE, Gate, Runner, poll, sema_keys
from tests.delayproxy import DelayProxy
from tests.etcd_server import EtcdCluster
from tests.faults.test_failures import expiry_floor
from tests.library.test_parity import Asyncio, Face, Threaded, _poll

OUTAGE = 3.0  # seconds etcd stays down
TTL = 10  # seconds
# Past any expiry the leases had when etcd went down (E <= the kill + TTL), with room: the
# command's observation window.
WATCH_FOR = TTL + 2.0  # seconds after the kill


def places(client: Client, name: str) -> list[tuple[int, int]]:
    """(create_revision, lease) of every key of the semaphore, in queue order."""
    return [(k.create_revision, k.lease) for k in sema_keys(client, name)]


def queued(client: Client, name: str, count: int) -> bool:
    return len(sema_keys(client, name)) == count


def runs_alone(gate: Gate, ident: str) -> bool:
    return gate.now_running() == {ident}


def store_revision(cluster: EtcdCluster) -> tuple[int, str]:
    """etcd's current revision and its release, as one member answers them."""
    with cluster.client() as client:
        revision = kv.range_prefix(client, b"/revision-probe/", keys_only=True).header.revision
        return revision, server_version(client) or "?"


def restart(cluster: EtcdCluster, outage: float = OUTAGE) -> float:
    """SIGKILL the one member, start it again on its data ``outage`` seconds later (the
    fault's length, not a wait for anything), wait until it serves reads; the instant of
    the kill.

    etcd 3.5.0-3.5.2 can lose writes it acknowledged when it is killed (etcd issue 13766:
    the consistent index was not saved atomically with the data; fixed in 3.5.3): it comes
    back at a lower revision and the keys made before the kill are gone or remade. No
    client keeps its place in a history the server forgot, so the test cannot be run then:
    an xfail on those releases, a failure on any other."""
    before, release = store_revision(cluster)
    member = cluster.members[0]
    member.kill()
    killed = time.monotonic()
    time.sleep(outage)
    member.start(cluster.initial_cluster)
    cluster.wait_healthy()
    after, _ = store_revision(cluster)
    if after < before:
        said = f"etcd {release} came back at revision {after} after a SIGKILL at {before}"
        if release in ("3.5.0", "3.5.1", "3.5.2"):
            pytest.xfail(f"{said}: it lost acknowledged writes (etcd issue 13766)")
        pytest.fail(f"{said}: the server lost acknowledged writes")
    return killed


_DEADLINE_REASON = re.compile(r"the lease can expire in (-?[0-9.]+)s")


def test_the_command_s_waiters_keep_their_places_and_the_child_its_deadline(
    own_etcd: EtcdCluster, tmp_path: Path, gate: Gate, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = Runner(own_etcd, tmp_path)
    try:
        sema = ("sema", name, "--max", "1", "--ttl", f"{TTL}s")
        holder = runner.start(*sema, "--", *gate.cmd("h"))
        poll(lambda: gate.now_running() == {"h"}, what="the holder's child")
        waiters = []
        with own_etcd.client() as client:
            for i in range(3):
                waiters.append(runner.start(*sema, "--wait", "5m", "--", *gate.cmd(f"w{i}")))
                poll(functools.partial(queued, client, name, 2 + i), what=f"waiter {i}")
            before = places(client, name)
        killed = restart(own_etcd)
        with own_etcd.client() as client:
            # Past every expiry from before the kill: a child stopped early would be by now.
            left = killed + WATCH_FOR - time.monotonic()
            if left > 0:
                time.sleep(left)  # the observation window
            after = places(client, name)
        stopped = "h" not in gate.now_running()
        lost_lines = [line for line in holder.log().splitlines() if "event=lost" in line]
        with capsys.disabled():
            if not stopped:
                print("\n[measure] restart: holder's child kept running (its lease confirmed)")
        if stopped:
            # Stopped: only by its deadline, as E came (or by etcd saying the lease is gone).
            assert lost_lines, holder.log()
            match = _DEADLINE_REASON.search(lost_lines[0])
            gone = "expired or was revoked" in lost_lines[0] or "key was deleted" in lost_lines[0]
            assert match or gone, lost_lines[0]
            if match:
                with capsys.disabled():
                    print(f"\n[measure] restart: SIGTERM {float(match.group(1)):.2f}s before E")
        else:
            assert lost_lines == [], lost_lines
        # Every waiter is where it was: same key, same create_revision, same lease.
        assert after[-3:] == before[1:], (before, after, [w.log() for w in waiters])
        for waiter in waiters:
            assert "event=requeue" not in waiter.log(), waiter.log()
        if not stopped:
            assert after[0] == before[0]
            gate.release("h")
            assert holder.wait() == 0
        for i, waiter in enumerate(waiters):
            poll(functools.partial(runs_alone, gate, f"w{i}"), what=f"waiter {i} runs")
            assert gate.rev(f"w{i}") == before[1 + i][0]
            gate.release(f"w{i}")
            assert waiter.wait() == 0
    finally:
        runner.cleanup()


# 5 s as well: etcd then comes back (1.6-1.8 s after its start) later than a keepalive sent
# just before the kill was given to be answered, which the old rule counted as loss.
@pytest.mark.parametrize("outage", [OUTAGE, 5.0], ids=["3s", "5s"])
@pytest.mark.parametrize("face_type", [Threaded, Asyncio], ids=["threaded", "asyncio"])
def test_the_library_s_waiters_keep_their_places_and_the_hold_lasts_to_e(
    own_etcd: EtcdCluster,
    name: str,
    face_type: type[Face],
    outage: float,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="conch")
    face: Face = face_type(own_etcd, 2.0)  # type: ignore[call-arg]

    async def scenario(fclient: Any) -> None:
        with own_etcd.client() as client:
            first = await face.acquire(face.semaphore(fclient, name, max=1, ttl=TTL), 10)
            waiting = []
            for i in range(3):
                sema = face.semaphore(fclient, name, max=1, ttl=TTL)
                waiting.append(asyncio.ensure_future(face.acquire(sema)))
                await _poll(functools.partial(queued, client, name, 2 + i), f"waiter {i}")
            before = places(client, name)
        lost_at: list[float] = []

        async def note_loss() -> None:
            await face.wait_lost(first)
            lost_at.append(time.monotonic())

        noting = asyncio.ensure_future(note_loss())
        expiry = face.expires_at(first)
        killed = await asyncio.to_thread(restart, own_etcd, outage)
        with own_etcd.client() as client:
            # Nothing from before the kill can end anything now once the hold is lost or
            # its E moved past any E it had then (a keepalive sent since, confirmed), and
            # each waiter's lease was kept alive since etcd came back (its expiry there moved
            # on past the new leader's renewal of every lease).
            waiters = [lease_id for _, lease_id in before[1:]]
            floors = {i: expiry_floor(client, i) for i in waiters}

            def settled() -> bool:
                kept = all(expiry_floor(client, i) > floors[i] + 1 for i in waiters)
                return kept and (noting.done() or face.expires_at(first) > killed + TTL)

            await asyncio.to_thread(poll, settled, what="the hold and the waiters settled")
            after = places(client, name)
        assert after[-3:] == before[1:], (before, after)
        with capsys.disabled():
            if lost_at:
                late = lost_at[0] - expiry
                print(
                    f"\n[measure] {outage:g}s restart ({face.name}): hold lost {late:.2f}s after E"
                )
            else:
                print(f"\n[measure] {outage:g}s restart ({face.name}): hold kept (lease confirmed)")
        if lost_at:
            said = first.reason if hasattr(first, "reason") else first.lost.reason
            reason = Loss.of(said)
            assert reason is LossReason.NO_KEEPALIVE or (reason and reason.slot_taken), said
            if reason is LossReason.NO_KEEPALIVE:
                assert lost_at[0] >= expiry - 0.05, (lost_at[0] - expiry, said)
        else:
            noting.cancel()
            await face.check(first)
        await face.release(first)
        for i, task in enumerate(waiting):
            hold = await asyncio.wait_for(task, DEADLINE)
            assert (hold.revision, hold.lease_id) == before[1 + i]
            await face.release(hold)

    async def main() -> None:
        async with face.connect() as fclient:
            await scenario(fclient)

    asyncio.run(main())
    # The same log events through either face: no waiter re-entered, nothing said lost but
    # (at most) the hold, at E.
    events = [r.getMessage() for r in caplog.records if r.name == "conch"]
    assert not [e for e in events if "event=requeue" in e], events
    assert len([e for e in events if "event=lost" in e]) <= 1, events


def test_a_slot_won_after_the_waiter_s_expiry_waits_for_a_keepalive_not_the_back_of_the_line(
    etcd: EtcdCluster, client: Client, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter's keepalive answers held back past its TTL (etcd got every keepalive and kept
    the lease; the waiter could not know it), then its slot comes free: the slot is won with
    E passed. It ran its child on that key once the next keepalive was confirmed; it used to
    give the slot back and queue again at the back ("hold lost before the child started:
    lease not confirmed alive"), though etcd never lost its lease."""
    caplog.set_level(logging.INFO, logger="conch")
    proxy = DelayProxy(("127.0.0.1", etcd.members[0].client_port), delay=0.0)
    marker = tmp_path / "ran"
    argv = ["sh", "-c", f'echo "$CONCH_LEASE $CONCH_REV" > {marker}']
    blocker = Semaphore(client, name, max=1, ttl=10).acquire(timeout=DEADLINE)
    result: list[int | BaseException] = []
    with Client.connect([Endpoint.parse(f"127.0.0.1:{proxy.port}")]) as through_proxy:
        sema = Semaphore(through_proxy, name, max=1, ttl=3)

        def wait_and_run() -> None:
            try:
                result.append(supervise(sema, argv, DEADLINE, 0.5, Flag("stop")))
            except BaseException as exc:
                result.append(exc)

        waiter = threading.Thread(target=wait_and_run)
        waiter.start()
        try:
            queued_key = poll(lambda: sema_keys(client, name)[1:], what="the waiter queued")[0]
            # Answers held back longer than a keepalive's deadline (TTL/3 + 0.5 s), shorter than
            # gRPC's ping timeout (5 s): no keepalive is confirmed, and the link stays up.
            proxy.delay = 4.0
            time.sleep(3.2)  # the fault's length: past the TTL from the last confirmed keepalive
            blocker.release()  # its deletion reaches the waiter 4 s later, before any answer
            proxy.delay = 0.0  # to keepalives sent from now on, once what is held is out
            waiter.join(DEADLINE)
        finally:
            proxy.close()
    assert result == [0], result
    assert "event=requeue" not in caplog.text, caplog.text
    assert marker.read_text().split() == [f"{queued_key.lease:x}", str(queued_key.create_revision)]
    assert sema_keys(client, name) == []
