"""conch under real network faults, with etcd members and wrappers in network namespaces
(tests/netns.py): the invariant harness on a seeded schedule of faults, and the liveness cases
it found. Skipped, saying why, where network namespaces cannot be made (not root, no iptables).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEADLINE, Conch, Runner, poll
from tests.netfaults import KINDS, run, timings
from tests.netns import Net, NetCluster, Node, skip_reason

SEED = 20261201

UNAVAILABLE = skip_reason() if sys.platform == "linux" else "not Linux"
pytestmark = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}"
)


class Lab:
    """A 3-member cluster and two client nodes, healed and settled between tests; ``runner``
    starts conch (TTL 3 s) in a node and kills what is left at the end of the test."""

    def __init__(self, net: Net, cluster: NetCluster, clients: list[Node]) -> None:
        self.net = net
        self.cluster = cluster
        self.clients = clients
        self.runner: Runner

    def conch(self, node: Node, *args: str, endpoints: str = "") -> Conch:
        endpoints = endpoints or self.cluster.endpoints
        return self.runner.start(
            *args, launcher=node.exec, CONCH_ENDPOINTS=endpoints, CONCH_TTL="3s"
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Net() as net:
        cluster = NetCluster(net, tmp_path_factory.mktemp("netetcd"))
        clients = [net.add(f"c{i}") for i in range(2)]
        try:
            cluster.start()
            yield Lab(net, cluster, clients)
        finally:
            cluster.stop()


@pytest.fixture
def settled(lab: Lab, tmp_path: Path) -> Iterator[Lab]:
    lab.cluster.settle()
    lab.runner = Runner(lab.cluster, tmp_path)
    try:
        yield lab
    finally:
        lab.runner.cleanup()
        lab.net.heal()


def test_network_faults_keep_the_promise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every fault kind once, N = 1, 4 wrappers on 4 client nodes (about 90 s)."""
    harness = run(SEED, 1, tmp_path, duration=70.0)
    report = harness.report
    with capsys.disabled():
        print(f"\n[netfaults] {report.summary()}\n{timings(harness.timeline)}")
    assert {f.kind for f in harness.timeline} == set(KINDS)
    assert report.spans, "no child ever ran"
    assert report.problems == []


def test_a_slow_lossy_link_does_not_cost_the_holds(settled: Lab, tmp_path: Path, name: str) -> None:
    """RTT +200 ms and 5% loss each way between the holders and every member, TTL 3 s, three
    endpoints: the keepalive waits for a late answer while it asks another member, so no hold
    is lost. (Giving one stream half the time left and then dropping it lost 3 of 3 holds.)"""
    node = settled.clients[0]
    settled.net.delay(node, settled.cluster.nodes, 0.1)
    settled.net.lose(node, settled.cluster.nodes, 0.05)
    holders = [
        settled.conch(node, "sema", name, "--max", "3", "--", "sleep", "12") for _ in range(3)
    ]
    codes = [h.wait(DEADLINE + 12) for h in holders]
    logs = "\n".join(h.log() for h in holders)
    assert codes == [0, 0, 0], logs
    assert "event=lost" not in logs


@pytest.mark.alone
def test_a_handoff_moves_off_a_leader_the_clients_cannot_reach(
    settled: Lab, tmp_path: Path, name: str
) -> None:
    """Holder and waiter, each on its own node, both talking to the leader, which they are
    then cut off from (the followers stay reachable) just as the holder's child ends: the
    holder's LeaseRevoke and the waiter's watch move to a follower within about a second."""
    leader = settled.cluster.settle()
    members = settled.cluster.members
    ordered = [members[leader], *(m for i, m in enumerate(members) if i != leader)]
    endpoints = ",".join(m.endpoint for m in ordered)
    go, marks = tmp_path / "go", tmp_path / "marks"
    holder_node, waiter_node = settled.clients

    def sema(node: Node, script: str) -> Conch:
        args = ("sema", name, "--max", "1", "--", "sh", "-c", script)
        return settled.conch(node, *args, endpoints=endpoints)

    holder = sema(
        holder_node,
        f'while [ ! -e {go} ]; do sleep 0.01; done; echo "end $(date +%s.%N)" >> {marks}',
    )
    poll(lambda: "child-start" in holder.events(), what="the holder's child")
    waiter = sema(waiter_node, f'echo "start $(date +%s.%N)" >> {marks}')
    # Its watch is on the leader next, or is being set up there: silent either way.
    poll(lambda: "queued" in waiter.events(), what="the waiter queued")
    for node in settled.clients:
        settled.net.cut_both(node, settled.cluster.nodes[leader])
    go.touch()
    assert holder.wait() == 0, holder.log()
    assert waiter.wait() == 0, waiter.log()
    stamps = dict(line.split() for line in marks.read_text().splitlines())
    handoff = float(stamps["start"]) - float(stamps["end"])
    print(f"[measure] leader cut off from the clients -> handoff {handoff:.2f}s")
    # 1.4-1.5 s here; 2.5 s at least with a first LeaseRevoke attempt of 2.5 s on the leader
    assert handoff < 2.3, f"{handoff:.2f}s\n{holder.log()}\n{waiter.log()}"
