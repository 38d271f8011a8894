"""Network namespaces for fault tests: etcd members and conch processes on a private network,
and the faults injected between them.

Every node is a network namespace of its own, joined by a veth pair to a bridge in a hub
namespace, on 10.77.0.0/24 (the hub's bridge is 10.77.0.254). Nothing is routed out of these
namespaces and the host's own namespace is never touched; names carry a per-run prefix, so
runs side by side do not meet. Faults are iptables rules in a FAULT chain of the *receiving*
namespace's INPUT (a DROP on OUTPUT returns an error to the sender, not silence): cuts, loss by
the ``statistic`` match, and delay through an NFQUEUE served by tests/nfdelay.py (this kernel
has no netem). The test process reaches the members through local TCP tunnels that connect
from inside the hub namespace (``NetCluster.client``).

Needs root, ``ip`` and ``iptables``; ``skip_reason()`` says why not when they are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conchpb.etcdserverpb import rpc_pb2

from conch.etcd import Client, Endpoint
from tests.etcd_server import EtcdCluster, Member

PREFIX = "cnf"  # namespaces are named cnf<pid of the test process>-<random>-<node>
SUBNET = "10.77.0"
HUB_ADDRESS = f"{SUBNET}.254"
CLIENT_PORT, PEER_PORT = 2379, 2380
DELAY_QUEUE = 7
CLONE_NEWNET = 0x40000000
NFDELAY = Path(__file__).with_name("nfdelay.py")


def skip_reason() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    name = f"cnfprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", name)
        try:
            _sh("ip", "netns", "exec", name, "iptables", "-L", "INPUT", "-n")
        finally:
            _sh("ip", "netns", "del", name)
    except subprocess.CalledProcessError as exc:
        return f"cannot make a network namespace with iptables: {exc.stderr.strip()}"
    return None


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


@dataclass
class Node:
    """One namespace on the private network."""

    name: str
    ns: str
    address: str

    @property
    def exec(self) -> list[str]:
        """The argv prefix that runs a command in this node's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def iptables(self, *rule: str) -> None:
        _sh(*self.exec, "iptables", "-w", *rule)


class Net:
    """A hub with a bridge and the nodes added to it; ``close()`` stops what was started in
    them (by PID) and deletes every namespace, also after a failure half-way."""

    def __init__(self) -> None:
        _sweep()
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.hub = f"{self.prefix}-hub"
        self.nodes: dict[str, Node] = {}
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._delayers: dict[str, subprocess.Popen[bytes]] = {}
        try:
            self._add_namespace(self.hub)
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def add(self, name: str) -> Node:
        node = Node(name, f"{self.prefix}-{name}", f"{SUBNET}.{len(self.nodes) + 1}")
        self._add_namespace(node.ns)
        port = f"p{len(self.nodes)}"
        _sh(
            "ip",
            "-n",
            self.hub,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "eth0",
            "netns",
            node.ns,
        )
        _sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _sh("ip", "-n", node.ns, "link", "set", "eth0", "up")
        for chain, hook in (("FAULT", "INPUT"), ("FAULTOUT", "OUTPUT")):
            node.iptables("-N", chain)
            node.iptables("-A", hook, "-j", chain)
        self.nodes[name] = node
        return node

    def popen(self, node: Node, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``node``'s namespace; ``close()`` kills it by PID."""
        proc = subprocess.Popen([*node.exec, *argv], start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self._processes.append(proc)
        return proc  # type: ignore[no-any-return]

    # Faults. Each adds rules; heal() removes them all.

    def cut(self, receiver: Node, sender: Node) -> None:
        """``receiver`` no longer hears ``sender`` (packets dropped silently on arrival)."""
        receiver.iptables("-A", "FAULT", "-s", sender.address, "-j", "DROP")

    def cut_both(self, a: Node, b: Node) -> None:
        self.cut(a, b)
        self.cut(b, a)

    def lose(self, node: Node, peers: list[Node], probability: float) -> None:
        """Drop ``probability`` of the packets each way between ``node`` and ``peers``."""
        chance = ["-m", "statistic", "--mode", "random", "--probability", f"{probability}"]
        for peer in peers:
            node.iptables("-A", "FAULT", "-s", peer.address, *chance, "-j", "DROP")
            peer.iptables("-A", "FAULT", "-s", node.address, *chance, "-j", "DROP")

    def delay(self, node: Node, peers: list[Node], seconds: float) -> None:
        """Delay every packet between ``node`` and ``peers`` by ``seconds`` each way (the
        round trip grows by twice that), in ``node``'s namespace."""
        delayer = self.popen(
            node,
            [sys.executable, str(NFDELAY), "--queue", str(DELAY_QUEUE), "--delay", f"{seconds}"],
            stdout=subprocess.PIPE,
        )
        assert delayer.stdout is not None
        if delayer.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the NFQUEUE delayer in {node.name} did not start")
        self._delayers[node.name] = delayer
        queue = ["-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE)]
        for peer in peers:
            node.iptables("-A", "FAULT", "-s", peer.address, *queue)
            node.iptables("-A", "FAULTOUT", "-d", peer.address, *queue)

    def heal(self) -> None:
        """Remove every fault; delayed packets still in flight are delivered first."""
        for node in self.nodes.values():
            node.iptables("-F", "FAULT")
            node.iptables("-F", "FAULTOUT")
        for delayer in self._delayers.values():  # each lets go of what it holds first
            _stop(delayer)
        self._delayers.clear()

    def close(self) -> None:
        for proc in reversed(self._processes):
            _stop(proc)
        for ns in reversed(self._namespaces):
            with contextlib.suppress(subprocess.CalledProcessError):
                _sh("ip", "netns", "del", ns)

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sweep() -> None:
    """Remove what a killed run left: namespaces of ours whose creating process is gone, after
    killing what still runs in them (an etcd outlives its namespace's deletion)."""
    for line in _sh("ip", "netns", "list").splitlines():
        ns = line.split()[0] if line.strip() else ""
        owner = ns[len(PREFIX) :].split("-")[0]
        if not ns.startswith(PREFIX) or not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        for pid in _sh("ip", "netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(subprocess.CalledProcessError):
            _sh("ip", "netns", "del", ns)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s, by PID (a process may outlive its namespace)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Tunnel:
    """A TCP listener on 127.0.0.1 in our namespace whose connections are forwarded to
    ``target`` from inside namespace ``ns`` (connect() runs in a thread moved there)."""

    def __init__(self, ns: str, target: tuple[str, int]) -> None:
        self._ns = ns
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="netns-tunnel").start()

    def _accept(self) -> None:
        while True:
            try:
                local, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(local,), daemon=True).start()

    def _connect(self, local: socket.socket) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            with open(f"/var/run/netns/{self._ns}") as ns:
                if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {self._ns}")
            remote = socket.create_connection(self._target, timeout=5)
        except OSError:  # the namespace is gone, or the member does not answer
            local.close()
            return
        remote.settimeout(None)
        threading.Thread(target=_pump, args=(remote, local), daemon=True).start()
        _pump(local, remote)

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class NetCluster(EtcdCluster):
    """``size`` etcd members, each in a node ``m<i>`` of ``net``. ``endpoints`` are their
    private addresses (for processes in the namespaces); ``client()`` reaches them from here
    through tunnels from the hub, which no fault touches."""

    def __init__(self, net: Net, base: Path, size: int = 3) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.tls = None
        self.net = net
        self.nodes = [net.add(f"m{i}") for i in range(size)]
        self.members = [
            Member(
                f"m{i}",
                base / f"m{i}",
                CLIENT_PORT,
                PEER_PORT,
                base / f"m{i}.log",
                host=node.address,
                launcher=node.exec,
            )
            for i, node in enumerate(self.nodes)
        ]
        self.tunnels = [Tunnel(net.hub, (node.address, CLIENT_PORT)) for node in self.nodes]

    def client(self, dial_timeout: float = 5.0, request_timeout: float = 5.0) -> Client:
        return Client.connect(
            [Endpoint("127.0.0.1", t.port, False) for t in self.tunnels],
            dial_timeout=dial_timeout,
            request_timeout=request_timeout,
        )

    def stop(self) -> None:
        super().stop()
        for tunnel in self.tunnels:
            tunnel.close()

    def statuses(self) -> list[rpc_pb2.StatusResponse | None]:
        """Maintenance.Status of each member (None for one that does not answer in 1 s)."""
        out: list[rpc_pb2.StatusResponse | None] = []
        for tunnel in self.tunnels:
            try:
                with Client([Endpoint("127.0.0.1", tunnel.port, False)]) as client:
                    out.append(client.call("maintenance", "Status", rpc_pb2.StatusRequest(), 1.0))
            except Exception:
                out.append(None)
        return out

    def leader(self) -> int | None:
        """The index of the member every member names leader, in one term; None if unsettled."""
        statuses = self.statuses()
        if any(s is None for s in statuses):
            return None
        views = {(s.leader, s.raftTerm) for s in statuses if s is not None}
        if len(views) != 1:
            return None
        leader_id = next(iter(views))[0]
        ids = [s.header.member_id for s in statuses if s is not None]
        return ids.index(leader_id) if leader_id in ids else None

    def settle(self, timeout: float = 60.0) -> int:
        """Wait until the cluster has one leader in one term, seen twice 0.5 s apart; return
        the leader's index."""
        deadline = time.monotonic() + timeout
        seen: int | None = None
        while time.monotonic() < deadline:
            now = self.leader()
            if now is not None and now == seen:
                return now
            seen = now
            time.sleep(0.5)
        raise AssertionError(f"the cluster did not settle in {timeout:g}s: {self.statuses()}")
