"""The invariant harness (tests/harness.py) under network faults: 3 etcd members and one conch
wrapper per client node, each in a network namespace of its own (tests/netns.py).

A seeded schedule applies one fault at a time for ``fault_time`` seconds, then heals it and
waits until the cluster has one leader in one term again:

* ``cut``: the holder cut off from every member, both ways; ``cut-in``: it hears no member;
  ``cut-out``: no member hears it;
* ``leader``: every client cut off from the leader (not from the followers);
* ``minority``: the leader cut off from the other members (clients still reach it);
* ``slow``: the holder's link 100 ms slower each way (RTT +200 ms) and 5% loss each way;
* ``flap``: the holder's link cut and restored every 0.2-1 s.

On top of the base harness's checks (at most N children except within TTL + kill-after of a
fault, every child ends, fencing tokens rise, every wrapper exits as it should, no key left),
with N = 1 no slot stays free beyond HANDOFF_BOUND while others wait, or, around a fault, beyond
the fault plus the TTL plus LEADER_CHANGE (a holder cut off keeps its slot until its lease
expires, and a new leader renews every lease when it takes office). Each fault's
detection time (fault to the holder's child's end) and handoff time (that end to the next
child's start) are measured.
"""

from __future__ import annotations

import itertools
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import Config, Harness
from tests.netns import Net, NetCluster, Node

KINDS = ("cut", "cut-in", "cut-out", "leader", "minority", "slow", "flap")
HANDOFF_BOUND = 3.0  # seconds a free slot may wait for a queued waiter with no fault around
# A fault that moves the leader adds its election (up to two election timeouts of 1 s) and
# the new leader's promotion, which extends every lease by one election timeout: a dead
# holder's key outlives the heal by the TTL plus up to 3 s (CI saw 11.35 s against 11.0).
LEADER_CHANGE = 3.0
# A wrapper cut off from every member cannot reach etcd: it exits 69 as documented.
NET_OK_EXITS = {0, 69, 70, 75, 128 + signal.SIGTERM, -signal.SIGTERM}


@dataclass
class Fault:
    kind: str
    start: float  # unix time
    end: float = 0.0
    holder: str | None = None  # the child running when it began (``w<i>.<run>``)
    lost: bool = False  # the holder's child was stopped (SIGTERM) rather than finishing
    detection: float | None = None  # seconds from the fault to the holder's child's end
    handoff: float | None = None  # seconds from that end to the next child's start
    # gaps between one child's end and the next one's start, for ends during the fault
    gaps: list[float] = field(default_factory=list)


@dataclass
class NetConfig(Config):
    clients: int = 4
    fault_time: float = 5.0  # seconds each fault lasts
    child_time: tuple[float, float] = (2.0, 5.0)  # long enough for a fault to cost the hold
    kinds: tuple[str, ...] = KINDS
    timings: list[Fault] = field(default_factory=list)


class NetHarness(Harness):
    """K wrappers spread over ``clients`` nodes; faults from KINDS between them and ``cluster``."""

    ok_exits = NET_OK_EXITS

    def __init__(
        self, config: NetConfig, cluster: NetCluster, clients: list[Node], workdir: Path
    ) -> None:
        super().__init__(config, cluster, workdir)
        self.net: Net = cluster.net
        self.cluster = cluster
        self.clients = clients
        self.netconfig = config
        self.timeline: list[Fault] = config.timings

    def launcher(self, index: int) -> list[str]:
        return self.clients[index % len(self.clients)].exec

    def _holder(self) -> str | None:
        """The wrapper whose child runs now, from the records (``w<i>.<run>``)."""
        running: dict[str, None] = {}
        for line in self.records.read_text().splitlines():
            kind, holder, *_ = line.split()
            if kind == "start":
                running[holder] = None
            else:
                running.pop(holder, None)
        return next(reversed(running), None)

    def _node_of(self, holder: str | None, rng: random.Random) -> Node:
        if holder is None:
            return rng.choice(self.clients)
        return self.clients[int(holder[1:].split(".")[0]) % len(self.clients)]

    def _inject(self) -> None:
        rng = self.rng
        kinds = list(self.netconfig.kinds)
        rng.shuffle(kinds)
        for kind in itertools.cycle(kinds):
            time.sleep(rng.uniform(1.0, 2.0))
            if time.monotonic() + self.netconfig.fault_time > self.stop_at:
                return
            holder = self._holder()
            fault = Fault(kind, time.time(), holder=holder)
            self.report.faults.append((fault.start, kind))
            self._apply(kind, self._node_of(holder, rng), rng)
            fault.end = time.time()
            self.net.heal()
            self.timeline.append(fault)
            self.cluster.settle()

    def _apply(self, kind: str, node: Node, rng: random.Random) -> None:
        """Apply one fault for ``fault_time`` seconds (``flap`` toggles meanwhile)."""
        members = self.cluster.nodes
        until = time.monotonic() + self.netconfig.fault_time
        if kind == "flap":
            while time.monotonic() < until:
                for member in members:
                    self.net.cut_both(node, member)
                time.sleep(rng.uniform(0.2, 1.0))
                self.net.heal()
                time.sleep(rng.uniform(0.2, 1.0))
            return
        if kind in ("cut", "cut-in", "cut-out"):
            for member in members:
                if kind != "cut-out":
                    self.net.cut(node, member)
                if kind != "cut-in":
                    self.net.cut(member, node)
        elif kind == "leader":
            leader = members[self.cluster.settle()]
            for client in self.clients:
                self.net.cut_both(client, leader)
        elif kind == "minority":
            leader = members[self.cluster.settle()]
            for member in members:
                if member is not leader:
                    self.net.cut_both(member, leader)
        elif kind == "slow":
            self.net.delay(node, members, 0.1)
            self.net.lose(node, members, 0.05)
        time.sleep(max(0.0, until - time.monotonic()))

    def _explained(self, begun: float, ended: float) -> bool:
        return any(f.start <= begun and ended <= f.end + self._window() for f in self.timeline)

    def _check(self) -> None:
        super()._check()
        self._measure()
        if self.config.max_holders == 1:
            self._check_handoffs()

    def _measure(self) -> None:
        """Detection and handoff time of each fault that hit a running child (N = 1)."""
        if self.config.max_holders != 1:
            return
        spans = sorted(self.report.spans, key=lambda s: s[2])
        stopped = {
            line.split()[1]
            for line in self.records.read_text().splitlines()
            if line.startswith("stop ")
        }
        for fault in self.timeline:
            ends = [s for s in spans if s[0] == fault.holder and s[3] >= fault.start]
            if not ends:
                continue
            ended = ends[0][3]
            fault.lost = fault.holder in stopped
            fault.detection = ended - fault.start
            later = [s[2] for s in spans if s[2] >= ended]
            if later:
                fault.handoff = later[0] - ended
        for before, after in itertools.pairwise(spans):
            for fault in self.timeline:
                if fault.start <= before[3] <= fault.end:
                    fault.gaps.append(max(0.0, after[2] - before[3]))

    def _check_handoffs(self) -> None:
        """With N = 1, the gaps between one child's end and the next one's start."""
        spans = sorted(self.report.spans, key=lambda s: s[2])
        ttl = self.config.ttl
        for before, after in itertools.pairwise(spans):
            gap = after[2] - before[3]
            near = any(
                f.start - ttl <= after[2] and before[3] <= f.end + ttl for f in self.timeline
            )
            bound = HANDOFF_BOUND + (
                ttl + self.netconfig.fault_time + LEADER_CHANGE if near else 0.0
            )
            if gap > bound:
                self.report.problems.append(
                    f"the slot stayed free {gap:.2f}s (bound {bound:.1f}s) from "
                    f"{before[3]:.3f} ({before[0]} ended) to {after[2]:.3f} ({after[0]} started)"
                )


def timings(faults: list[Fault]) -> str:
    """Per fault kind: how many holds it cost, and over those, median and max of the
    detection and handoff times; and of the gaps between children while it lasted."""
    lines = []
    for kind in KINDS:
        hits = [f for f in faults if f.kind == kind]
        if not hits:
            continue
        lost = [f for f in hits if f.lost]
        line = f"{kind:9} faults={len(hits)} holds_lost={len(lost)}"
        for what, values in (
            ("detection", [f.detection for f in lost if f.detection is not None]),
            ("handoff", [f.handoff for f in lost if f.handoff is not None]),
            ("gap", [gap for f in hits for gap in f.gaps]),
        ):
            if values:
                line += (
                    f" {what} n={len(values)} median={statistics.median(values):.2f}s"
                    f" max={max(values):.2f}s"
                )
        lines.append(line)
    return "\n".join(lines)


def run(
    seed: int,
    max_holders: int,
    workdir: Path,
    duration: float,
    workers: int = 4,
    kinds: tuple[str, ...] = KINDS,
) -> NetHarness:
    """One seeded run on a fresh network and cluster; returns the harness (its report and
    its timeline of faults)."""
    config = NetConfig(
        seed=seed, max_holders=max_holders, workers=workers, duration=duration, kinds=kinds
    )
    with Net() as net:
        cluster = NetCluster(net, workdir / "etcd")
        clients = [net.add(f"c{i}") for i in range(config.clients)]
        try:
            cluster.start()
            cluster.settle()
            harness = NetHarness(config, cluster, clients, workdir)
            harness.run()
        finally:
            cluster.stop()
    return harness
