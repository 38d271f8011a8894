"""The overlap harness: how long more than N children of one semaphore run at once under a
fault, measured by the children themselves, not by log lines.

Three etcd members, each in a network namespace (tests/netns.py), and two client nodes: N
*holders* on node ``h``, each given one member's endpoint only (the *target*), and N
*waiters* on node ``w`` given the other two members. Every child ignores SIGTERM and, as it
starts, connects to a Unix socket at a filesystem path (such sockets reach across network
namespaces) and says who it is; it holds the connection open until it dies, so the
connection's end of file is its death as the kernel sees it, whatever signal killed it. The
monitor stamps both on one monotonic clock; the invariant is that at no instant are more than
N children alive.

Faults, applied once the holders' children run and the waiters are queued, and kept until
the waiters' children run and the holders' are dead (or a cap):

* ``member-frozen``: the target member SIGSTOPped;
* ``cut-both``: the target member cut off from every other node, both ways;
* ``cut-peers``: the target member cut off from its peers only (the holders still reach it);
* ``wrapper-frozen``: the holding conch processes SIGSTOPped (not their children or
  watchdogs);
* ``watchdog-killed``: each holder's watchdog SIGKILLed, and half a second later its conch
  SIGSTOPped;
* ``watchdog-stopped``: each holder's watchdog SIGSTOPped, and half a second later its conch
  SIGSTOPped (both resumed at the heal).

Each fault is run at ``--ttl 10s --kill-after 5s`` and ``--ttl 3s --kill-after 1s`` (and
``--ttl 10s`` with conch's own ``--kill-after``), at N = 1 and N = 3; the member faults with
the target the leader and a follower (found with Maintenance.Status).

Beside the children, the harness records each holder's log lines as they come (stamped on
arrival) and polls, through a healthy member, the remaining TTL of each conch's lease
(Lease.LeaseTimeToLive, every 100 ms). Each answer ``r`` (whole seconds, rounded down by etcd)
to a request sent at ``t`` promises that the lease lives until ``t + r`` at least. A lease
gone before its promise while its holder's child still ran (conch revokes only after its
child is dead) was expired or revoked early by etcd itself (etcd issues 15247 and 12528: a
frozen leader that resumes revokes leases kept alive through the new leader): such a case is
reported apart, as etcd's failure, not conch's.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conch import keys
from conch.etcd import Client, Endpoint, kv, lease
from tests.netns import Net, NetCluster, Node

# The child: ignores SIGTERM, says hello to the monitor (label, fencing token, lease, pid,
# conch's pid, and the monotonic time its first statement ran, which the monitor takes as
# its start when it is earlier than the connection) and waits for the monitor to let it
# go; only SIGKILL ends it before that. CLOCK_MONOTONIC is one clock for every namespace.
CHILD = (
    "import time\n"
    "t = time.monotonic()\n"
    "import os, signal, socket, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.connect(sys.argv[1])\n"
    "e = os.environ\n"
    "s.sendall(f\"{sys.argv[2]} {e['CONCH_REV']} {e['CONCH_LEASE']} {os.getpid()} "
    '{os.getppid()} {t!r}\\n".encode())\n'
    "s.recv(1)\n"
)

FAULTS = (
    "member-frozen",
    "cut-both",
    "cut-peers",
    "wrapper-frozen",
    "watchdog-killed",
    "watchdog-stopped",
)
MEMBER_FAULTS = ("member-frozen", "cut-both", "cut-peers")
ROLES = ("leader", "follower")
POLL = 0.1  # seconds between two LeaseTimeToLive polls of one lease
# Seconds from the watchdog's SIGKILL to its conch's SIGSTOP: less than the --kill-after of
# either setting, so a SIGTERM and its grace cannot be all; conch sees the death in ms.
WATCHDOG_TO_FREEZE = 0.5
START_TIMEOUT = 60.0  # seconds for conch processes to start, queue, hold (a loaded host)
# The reasons of conch's "lost" lines that mean etcd itself showed the lease or key gone.
GONE_IN_ETCD = ("key was deleted", "expired or was revoked")
STALL = 1.0  # seconds with no answer from the healthy members that count as etcd stalled
AFTER_HEAL = 2.0  # seconds the waiters' children run on once the fault is healed
EXIT_TIMEOUT = 60.0  # seconds for every conch to exit once the children are let go


@dataclass(frozen=True)
class Settings:
    name: str  # as scripts/overlap.py's --settings takes it
    ttl: int  # seconds
    kill_after: float | None  # seconds; None: no --kill-after, conch's default for the TTL

    @property
    def label(self) -> str:
        grace = "default" if self.kill_after is None else f"{self.kill_after:g}s"
        return f"ttl={self.ttl}s ka={grace}"

    def flags(self) -> list[str]:
        grace = [] if self.kill_after is None else ["--kill-after", f"{self.kill_after:g}s"]
        return ["--ttl", f"{self.ttl}s", *grace]


LONG = Settings("long", 10, 5.0)  # conch's defaults as issue 23 measured them
SHORT = Settings("short", 3, 1.0)
DEFAULT = Settings("default", 10, None)  # the command's own --kill-after for TTL 10 s
SETTINGS = {s.name: s for s in (LONG, SHORT, DEFAULT)}


@dataclass(frozen=True)
class Case:
    fault: str
    role: str | None  # the target member: "leader" or "follower"; None for wrapper faults
    settings: Settings
    max_holders: int

    @property
    def label(self) -> str:
        where = f"/{self.role}" if self.role else ""
        return f"{self.fault}{where} {self.settings.label} N={self.max_holders}"

    @property
    def cap(self) -> float:
        """The longest a fault is kept (seconds): well past the lease's expiry plus the
        kill-after, so an overlap that never ends is measured as at least this long."""
        return 2 * self.settings.ttl + (self.settings.kill_after or 5.0) + 10.0


def matrix(
    capacities: tuple[int, ...] = (1, 3), settings_of: tuple[Settings, ...] = (LONG, SHORT)
) -> list[Case]:
    """Every fault, role, setting and capacity."""
    out = []
    for settings, n in itertools.product(settings_of, capacities):
        for fault in FAULTS:
            for role in ROLES if fault in MEMBER_FAULTS else (None,):
                out.append(Case(fault, role, settings, n))
    return out


@dataclass
class Child:
    """One child as the monitor saw it: start (its first statement, or its connection if
    that came first) and end (end of file), monotonic."""

    start: float
    end: float | None = None
    label: str = "?"
    rev: int = 0
    lease: int = 0
    pid: int = 0
    conch_pid: int = 0


class ChildMonitor:
    """A Unix socket server at ``path`` that the children connect to; ``release()`` lets them
    all go (each ends on the end of file of its connection)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.children: list[Child] = []
        self._changed = threading.Condition()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(64)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._open: dict[socket.socket, tuple[Child, bytearray]] = {}
        self._thread = threading.Thread(target=self._serve, daemon=True, name="child-monitor")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            for key, _ in self._selector.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    return
                if sock is self._server:
                    conn, _ = self._server.accept()
                    child = Child(start=time.monotonic())
                    with self._changed:
                        self.children.append(child)
                        self._open[conn] = (child, bytearray())
                    self._selector.register(conn, selectors.EVENT_READ)
                    continue
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                now = time.monotonic()
                with self._changed:
                    child, buffer = self._open[sock]
                    if data:
                        buffer += data
                        if b"\n" in buffer and child.label == "?":
                            label, rev, lease_hex, pid, ppid, began = buffer.split()[:6]
                            child.start = min(child.start, float(began))
                            child.label = label.decode()
                            child.rev, child.lease = int(rev), int(lease_hex, 16)
                            child.pid, child.conch_pid = int(pid), int(ppid)
                    else:
                        child.end = now
                        del self._open[sock]
                        self._selector.unregister(sock)
                        sock.close()
                    self._changed.notify_all()

    def wait(self, check: Callable[[list[Child]], bool], timeout: float) -> bool:
        """Whether ``check(children)`` came true within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not check(self.children):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def release(self) -> None:
        """Let every child go: its read of the connection ends."""
        with self._changed:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        with self._changed:
            for sock in self._open:
                sock.close()
            self._open.clear()
        for sock in (self._server, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()


class Wrapper:
    """One ``python -m conch sema`` in a node, its stderr lines stamped (monotonic) as they
    arrive and copied to ``log``."""

    def __init__(
        self, net: Net, node: Node, label: str, argv: list[str], env: dict[str, str], log: Path
    ) -> None:
        self.label = label
        self.lines: list[tuple[float, str]] = []
        self.proc = net.popen(
            node,
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True, name="conch-stderr")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self._log.open("w") as log:
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace").rstrip()
                self.lines.append((time.monotonic(), line))
                log.write(line + "\n")

    def event(self, name: str) -> tuple[float, str] | None:
        """The first log line of ``event=name``, with its arrival time."""
        return next(((t, line) for t, line in self.lines if f"event={name} " in f"{line} "), None)

    def lease(self) -> int | None:
        """The lease ID from the ``session`` line, once it came."""
        found = self.event("session")
        if found is None:
            return None
        fields = dict(w.split("=", 1) for w in found[1].split() if "=" in w)
        return int(fields["lease"], 16)

    def saw_lease_gone(self) -> float | None:
        """When this conch reported a loss that etcd itself showed (our key deleted, the
        lease expired or revoked), as opposed to one it inferred (no answer in time)."""
        for at, line in self.lines:
            if "event=lost " in line and any(why in line for why in GONE_IN_ETCD):
                return at
        return None

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)
        return code


@dataclass
class Sample:
    sent: float  # monotonic
    answered: float
    ttl: int  # seconds left as etcd reported it; -1: gone


# etcd's Remaining() for a lease of a lessor that is not primary: math.MaxInt64 ns, in s.
FOREVER = 9_223_372_036


class LeaseWatch:
    """Polls Lease.LeaseTimeToLive of the leases given, through ``client`` (healthy members
    only), every POLL seconds, each call with a 0.5 s deadline."""

    def __init__(self, client: Client) -> None:
        self.samples: dict[int, list[Sample]] = {}
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="lease-watch")

    def start(self, leases: list[int]) -> None:
        for lease_id in leases:
            self.samples[lease_id] = []
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL):
            for lease_id, samples in self.samples.items():
                if samples and samples[-1].ttl < 0:
                    continue
                sent = time.monotonic()
                try:
                    ttl = lease.time_to_live(self._client, lease_id, timeout=0.5)
                except Exception:  # the member is busy electing, or away: no sample
                    continue
                samples.append(Sample(sent, time.monotonic(), ttl))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


@dataclass
class Window:
    """An interval with more than N children alive."""

    start: float
    end: float
    peak: int
    who: list[str]

    @property
    def length(self) -> float:
        return self.end - self.start


def overlaps(children: list[Child], capacity: int, until: float) -> list[Window]:
    """Every interval in which more than ``capacity`` children were alive (a child still
    alive counts until ``until``); a death at the instant of a start comes first."""
    events = sorted(
        [(c.start, 1, i) for i, c in enumerate(children)]
        + [(c.end if c.end is not None else until, -1, i) for i, c in enumerate(children)],
        key=lambda e: (e[0], e[1]),
    )
    windows: list[Window] = []
    alive: set[int] = set()
    current: Window | None = None
    for at, delta, index in events:
        if delta > 0:
            alive.add(index)
        else:
            alive.discard(index)
        if len(alive) > capacity:
            if current is None:
                current = Window(at, at, len(alive), [])
            current.peak = max(current.peak, len(alive))
            for i in sorted(alive):
                if children[i].label not in current.who:
                    current.who.append(children[i].label)
        elif current is not None:
            current.end = at
            windows.append(current)
            current = None
    return windows


@dataclass
class Result:
    case: Case
    seed: int
    fault_at: float = 0.0  # monotonic
    windows: list[Window] = field(default_factory=list)
    etcd_early: list[str] = field(default_factory=list)
    etcd_notes: list[str] = field(default_factory=list)  # what else etcd did that cost a hold
    problems: list[str] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)

    @property
    def largest(self) -> float:
        return max((w.length for w in self.windows), default=0.0)

    @property
    def clearance(self) -> float | None:
        """How long before the k-th waiter's child started the k-th holder's child had died,
        the least over k (seconds; negative: they overlapped); None if the case did not get
        that far. How close the run came to an overlap."""
        deaths = sorted(c.end for c in self.children if c.label.startswith("h") and c.end)
        starts = sorted(c.start for c in self.children if c.label.startswith("w"))
        n = self.case.max_holders
        if len(deaths) < n or len(starts) < n:
            return None
        return min(s - d for s, d in zip(starts[:n], deaths[:n], strict=True))

    @property
    def verdict(self) -> str:
        """``ok`` (never more than N), ``etcd`` (an overlap after etcd ended a lease before
        its promise) or ``conch`` (an overlap with no such excuse)."""
        if not self.windows:
            return "ok"
        return "etcd" if self.etcd_early else "conch"

    def summary(self) -> str:
        line = f"{self.case.label:42} seed={self.seed} overlap={self.largest:.3f}s"
        if self.clearance is not None:
            line += f" clearance={self.clearance:.3f}s"
        if self.windows:
            w = max(self.windows, key=lambda w: w.length)
            line += f" at +{w.start - self.fault_at:.2f}s ({','.join(w.who)}, peak {w.peak})"
        if self.etcd_early:
            line += " ETCD-EARLY"
        if self.etcd_notes:
            line += " ETCD-ELECTION"
        return line

    def report(self) -> str:
        """The summary, etcd's early expiries, the problems and the timeline (seconds from
        the fault)."""
        lines = [self.summary()]
        lines += [f"  etcd: {e}" for e in self.etcd_early + self.etcd_notes]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  {t - self.fault_at:+8.3f} {what}" for t, what in sorted(self.timeline)]
        return "\n".join(lines)


class Lab:
    """A private network with 3 etcd members and the client nodes ``h`` (holders) and ``w``
    (waiters); ``run(case, seed)`` runs one case on it. Close it (a context manager) to stop
    everything in it and delete its namespaces."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.net = Net()
        try:
            self.cluster = NetCluster(self.net, workdir / "etcd")
            self.holder_node = self.net.add("h")
            self.waiter_node = self.net.add("w")
            self.cluster.start()
        except BaseException:
            self.close()
            raise
        self._runs = 0

    def close(self) -> None:
        try:
            self.cluster.stop()
        finally:
            self.net.close()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self, members: list[int]) -> Client:
        """A Client of the members of these indexes, through the hub's tunnels."""
        tunnels = [self.cluster.tunnels[i] for i in members]
        return Client([Endpoint("127.0.0.1", t.port, False) for t in tunnels])

    def run(self, case: Case, seed: int) -> Result:
        """One case: holders, waiters, the fault, and what the children, the logs and the
        lease's TTL showed."""
        self._runs += 1
        work = self.workdir / f"run{self._runs}"
        work.mkdir(parents=True)
        sockdir = Path(tempfile.mkdtemp(prefix="ovl", dir="/tmp"))  # sun_path: 108 bytes
        monitor = ChildMonitor(sockdir / "children")
        result = Result(case, seed)
        wrappers: list[Wrapper] = []
        try:
            _Run(self, case, seed, work, sockdir / "children", monitor, result, wrappers).go()
        finally:
            monitor.release()
            for wrapper in wrappers:  # leftovers: as Net.close would, but now
                if wrapper.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(wrapper.proc.pid, signal.SIGCONT)
                        os.kill(wrapper.proc.pid, signal.SIGKILL)
                    wrapper.proc.wait()
            for child in monitor.children:
                if child.end is None and child.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
            monitor.close()
            shutil.rmtree(sockdir, ignore_errors=True)
        return result


class _Run:
    """The steps of one case (Lab.run)."""

    def __init__(
        self,
        lab: Lab,
        case: Case,
        seed: int,
        work: Path,
        path: Path,
        monitor: ChildMonitor,
        result: Result,
        wrappers: list[Wrapper],
    ) -> None:
        self.lab, self.case, self.work, self.path = lab, case, work, path
        self.monitor, self.result, self.wrappers = monitor, result, wrappers
        self.rng = random.Random(seed)
        self.name = f"ovl-{seed}-{secrets.token_hex(3)}"
        self.holders: list[Wrapper] = []
        self.waiters: list[Wrapper] = []
        self.target = 0
        self.healthy: list[int] = []
        self.term_at_heal = 0
        self.healed_at = 0.0  # monotonic
        self.watched_until = 0.0  # monotonic: the lease watch's end

    def go(self) -> None:
        case, lab, result = self.case, self.lab, self.result
        n = case.max_holders
        leader = lab.cluster.settle()
        self.target = leader if case.role == "leader" else (leader + 1) % 3
        self.healthy = [i for i in range(3) if i != self.target]
        result.timeline.append((time.monotonic(), f"leader m{leader}, target m{self.target}"))
        for i in range(n):
            self.holders.append(self._conch(lab.holder_node, f"h{i}", [self.target]))
        if not self.monitor.wait(lambda cs: _started(cs, "h") == n, START_TIMEOUT):
            result.problems.append(f"the holders' children did not start in {START_TIMEOUT:g}s")
            return
        for i in range(n):
            self.waiters.append(self._conch(lab.waiter_node, f"w{i}", self.healthy))
        if not _poll(lambda: all(w.event("queued") for w in self.waiters), START_TIMEOUT):
            result.problems.append(f"the waiters did not queue in {START_TIMEOUT:g}s")
            return
        leases = [w.lease() for w in self.wrappers]
        with lab.client(self.healthy) as client:
            watch = LeaseWatch(client)
            watch.start([x for x in leases if x is not None])
            try:
                # A random phase of the keepalive cycle (TTL/3) at the fault.
                time.sleep(self.rng.uniform(0.5, 0.5 + case.settings.ttl / 3))
                self._fault_and_heal()
                # What the healed member does next counts too: a leader that resumes may
                # revoke the leases kept alive meanwhile through the new leader.
                self.monitor.wait(lambda cs: _alive(cs, "w") < n, AFTER_HEAL)
            finally:
                watch.stop()
                self.watched_until = time.monotonic()
            self._finish(watch)

    def _conch(self, node: Node, label: str, members: list[int]) -> Wrapper:
        s = self.case.settings
        endpoints = ",".join(self.lab.cluster.members[i].endpoint for i in members)
        argv = [
            sys.executable, "-m", "conch", "sema", self.name,
            "--max", str(self.case.max_holders), *s.flags(), "--endpoints", endpoints,
            "--", sys.executable, "-I", "-S", "-c", CHILD, str(self.path), label,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", CONCH_HOST=label)
        wrapper = Wrapper(self.lab.net, node, label, argv, env, self.work / f"{label}.log")
        self.wrappers.append(wrapper)
        return wrapper

    def _fault_and_heal(self) -> None:
        case, result, monitor = self.case, self.result, self.monitor
        n = case.max_holders
        result.fault_at = time.monotonic()
        heal = self._apply()
        try:
            done = monitor.wait(
                lambda cs: _started(cs, "w") >= n and _alive(cs, "h") == 0, case.cap
            )
            if not done:
                result.problems.append(
                    f"after {case.cap:g}s: {_alive(monitor.children, 'h')} holders' children "
                    f"alive, {_started(monitor.children, 'w')} waiters' started"
                )
        finally:
            # The term before the heal: an election the heal sets off comes after it.
            self.term_at_heal = self._term()
            heal()
            self.healed_at = time.monotonic()
            result.timeline.append((self.healed_at, "healed"))

    def _apply(self) -> Callable[[], None]:
        """Apply the case's fault; return what heals it."""
        fault, net, result = self.case.fault, self.lab.net, self.result
        member = self.lab.cluster.members[self.target]
        node = self.lab.cluster.nodes[self.target]
        result.timeline.append((time.monotonic(), f"FAULT {fault} m{self.target}"))
        if fault == "member-frozen":
            member.pause()
            return member.resume
        if fault in ("cut-both", "cut-peers"):
            others = [self.lab.cluster.nodes[i] for i in self.healthy]
            if fault == "cut-both":
                others += [self.lab.holder_node, self.lab.waiter_node]
            for other in others:
                net.cut_both(node, other)
            return net.heal
        conchs = [c.conch_pid for c in self.monitor.children if c.label.startswith("h")]
        dogs: list[int] = []
        if fault in ("watchdog-killed", "watchdog-stopped"):
            sig = signal.SIGKILL if fault == "watchdog-killed" else signal.SIGSTOP
            for pid in conchs:
                dog = _watchdog_of(pid)
                if dog is None:
                    result.problems.append(f"no watchdog found for conch {pid}")
                    continue
                os.kill(dog, sig)
                dogs.append(dog)
                result.timeline.append((time.monotonic(), f"watchdog {dog} of {pid} {sig.name}"))
            time.sleep(WATCHDOG_TO_FREEZE)
        for pid in conchs:
            os.kill(pid, signal.SIGSTOP)
            result.timeline.append((time.monotonic(), f"conch {pid} SIGSTOPped"))

        def resume() -> None:
            for pid in conchs + (dogs if fault == "watchdog-stopped" else []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        return resume

    def _finish(self, watch: LeaseWatch) -> None:
        result, monitor = self.result, self.monitor
        released = time.monotonic()
        monitor.release()
        codes = {w: w.wait(EXIT_TIMEOUT) for w in self.wrappers}
        # A member back from a partition with a higher raft term deposes the leader (etcd
        # without pre-vote, 3.4's default): keepalives go unanswered meanwhile, and a
        # waiter that held by then may lose its hold, failing closed. etcd's doing.
        term = self._term()
        elected = term > self.term_at_heal
        if elected:
            result.etcd_notes.append(
                f"an election after the heal (raft term {self.term_at_heal} -> {term})"
            )
        # A lease's TTL read as "forever" (2**63 ns) is etcd answering from a lessor that is
        # not primary: leadership moved, whatever terms the members reported (CI saw one such
        # sample on a healed follower's cluster, and the waiter that held then lost its hold).
        if not elected and any(
            sample.ttl >= FOREVER for samples in watch.samples.values() for sample in samples
        ):
            elected = True
            result.etcd_notes.append("a lessor demoted after the fault (a lease read 'forever')")
        # A cluster that commits nothing for a while (a slow fsync, a starved member on a
        # loaded host) leaves keepalives unanswered as an election does: the lease watch,
        # through the same healthy members, sees it as a silence.
        silence = _silence(watch.samples, self.healed_at, self.watched_until)
        if not elected and silence >= STALL:
            elected = True
            result.etcd_notes.append(
                f"the healthy members answered no LeaseTimeToLive for {silence:.2f}s after the heal"
            )
        for wrapper, code in codes.items():
            expected = 70 if wrapper in self.holders else 0
            if code == expected:
                continue
            if elected and code == 70:
                result.etcd_notes.append(f"conch {wrapper.label} lost its hold meanwhile")
            else:
                result.problems.append(f"conch {wrapper.label} exited {code}, not {expected}")
        children = monitor.children
        result.children = children
        result.windows = overlaps(children, self.case.max_holders, released)
        self._timeline(watch)
        told = {
            lease_id: at
            for wrapper in self.wrappers
            if (lease_id := wrapper.lease()) is not None
            and (at := wrapper.saw_lease_gone()) is not None
        }
        result.etcd_early = early_ends(watch.samples, children, told, result.fault_at)
        left = self._keys_left()
        if left:
            result.problems.append(f"keys left in etcd: {left}")

    def _timeline(self, watch: LeaseWatch) -> None:
        timeline = self.result.timeline
        for child in self.monitor.children:
            timeline.append((child.start, f"child {child.label} rev={child.rev} starts"))
            if child.end is not None:
                timeline.append((child.end, f"child {child.label} dies"))
        for wrapper in self.wrappers:
            for at, line in wrapper.lines:
                timeline.append((at, f"[{wrapper.label}] {line.removeprefix('conch: ')}"))
        for lease_id, samples in watch.samples.items():
            # Every change of the TTL etcd reports: a rise is a keepalive etcd received.
            previous: Sample | None = None
            for sample in samples:
                if sample.ttl < 0:
                    timeline.append((sample.answered, f"lease {lease_id:x} gone"))
                elif previous is None or sample.ttl != previous.ttl:
                    timeline.append((sample.sent, f"lease {lease_id:x} ttl={sample.ttl}s"))
                previous = sample
            alive = [s.sent + s.ttl for s in samples if s.ttl >= 0]
            if alive:
                promise = max(alive)
                timeline.append((promise, f"lease {lease_id:x}: etcd's promise runs out"))
        for window in self.result.windows:
            timeline.append(
                (window.start, f"OVERLAP {window.length:.3f}s, peak {window.peak}: {window.who}")
            )

    def _term(self) -> int:
        """The highest raft term the members report (Maintenance.Status, 1 s each)."""
        return max((s.raftTerm for s in self.lab.cluster.statuses() if s is not None), default=0)

    def _keys_left(self) -> list[bytes]:
        """Keys of our semaphore still in etcd a TTL (and 10 s) after every conch exited."""
        deadline = time.monotonic() + self.case.settings.ttl + 10
        left: list[bytes] = []
        with self.lab.client([0, 1, 2]) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    left = [i.key for i in kv.range_prefix(client, keys.name_prefix(self.name)).kvs]
                    if not left:
                        return []
                time.sleep(0.2)
        return left


def _silence(samples: dict[int, list[Sample]], start: float, end: float) -> float:
    """The longest time in [start, end] with no LeaseTimeToLive answered, in seconds."""
    answered = sorted(s.answered for ss in samples.values() for s in ss if start < s.answered < end)
    marks = [start, *answered, end]
    return max(b - a for a, b in itertools.pairwise(marks))


def _started(children: list[Child], side: str) -> int:
    return sum(1 for c in children if c.label.startswith(side))


def _alive(children: list[Child], side: str) -> int:
    return sum(1 for c in children if c.label.startswith(side) and c.end is None)


def _poll(check: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _watchdog_of(conch_pid: int) -> int | None:
    """The pid of conch's watchdog: its child running _watchdog_main.py."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == conch_pid and b"_watchdog_main" in cmdline:
            return int(entry.name)
    return None


def early_ends(
    samples_of: dict[int, list[Sample]],
    children: list[Child],
    told_gone: dict[int, float],
    origin: float,
) -> list[str]:
    """The leases etcd ended before its own promise (one line each, times in seconds from
    ``origin``). A TimeToLive sent at ``t`` that answered ``r`` seconds promises the lease
    until ``t + r`` at least (etcd rounds down). A lease is known gone by the first of: an
    answer that says so while its child still ran (conch revokes only after its child is
    dead, so that was not conch), and the time its conch reported a loss seen in etcd itself
    (``told_gone``: our key deleted, the lease expired or revoked)."""
    out = []
    for lease_id, samples in samples_of.items():
        alive = [s for s in samples if s.ttl >= 0]
        if not alive:
            continue
        promise = max(s.sent + s.ttl for s in alive)
        child = next((c for c in children if c.lease == lease_id), None)
        seen: list[tuple[float, str]] = []
        gone = next((s for s in samples if s.ttl < 0), None)
        if gone is not None and child is not None and (child.end or math.inf) > gone.answered:
            seen.append((gone.answered, "a TimeToLive answer, its child still running"))
        if lease_id in told_gone:
            seen.append((told_gone[lease_id], "its conch, which saw it gone in etcd"))
        if not seen:
            continue
        at, by = min(seen)
        if at < promise:
            label = child.label if child else "?"
            out.append(
                f"lease {lease_id:x} ({label}) was gone by {at - origin:+.3f}s ({by}), "
                f"{promise - at:.3f}s before etcd's promise ({promise - origin:+.3f}s)"
            )
    return out
