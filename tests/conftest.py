"""Fixtures: a real etcd for the session, conch processes, and polling with deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from conchpb.etcdserverpb import rpc_pb2

from conch.etcd import Client, kv
from tests.delayproxy import FaultProxy
from tests.etcd_server import EtcdCluster

T = TypeVar("T")

# Generous bounds: the suite runs on a shared, noisy 2-core machine.
DEADLINE = 30.0


def poll(check: Callable[[], T], timeout: float = DEADLINE, what: str = "condition") -> T:
    """Call ``check`` until it returns something truthy or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# -- running side by side (scripts/test.sh: pytest-xdist workers) ----------------------------
#
# Each worker has its own session etcd, its own temp dirs and its own ports (free_port in
# tests/etcd_server.py); network-namespace labs have their own namespaces, bridge and NFQUEUE
# (tests/netns.py). Two things are arranged here:
#
# - ``@pytest.mark.alone``: a test that measures (a latency bound of a second or less, an
#   event loop's stalls, a race it must win by being prompt) does not share the machine with
#   other tests of the run. scripts/test.sh runs the others on several workers
#   (``--phase shared``), then these in one process (``--phase alone``).
# - the files whose module-scoped fixture is a lab of several etcd members in network
#   namespaces run on one worker each, so each lab is built once, not once per worker.

ONE_WORKER_FILES = {"test_netfaults.py", "test_overlap.py"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=("all", "shared", "alone"),
        default="all",
        help="all tests (default); only those that can share the machine; only @alone ones",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "alone: measures time, so scripts/test.sh runs it with no other test beside it"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("--phase")
    if phase != "all":
        wanted = phase == "alone"
        kept = [item for item in items if (item.get_closest_marker("alone") is not None) == wanted]
        dropped = [item for item in items if item not in kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    for item in items:
        if item.path.name in ONE_WORKER_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member cluster of this test's own."""
    c = EtcdCluster(tmp_path / "cluster", size=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A one-member etcd of this test's own: what it counts (watchers) is this test's alone,
    and a test may take it down."""
    c = EtcdCluster(tmp_path / "own")
    c.start()
    yield c
    c.stop()


@pytest.fixture
def proxies(etcd: EtcdCluster) -> Iterator[Callable[[], FaultProxy]]:
    """Makes FaultProxies (tests/delayproxy.py) in front of the session etcd, each for a client
    of its own whose calls a test counts or makes fail; closed when the test ends."""
    made: list[FaultProxy] = []

    def make() -> FaultProxy:
        made.append(FaultProxy(etcd.members[0].endpoint))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


@pytest.fixture
def client(etcd: EtcdCluster) -> Iterator[Client]:
    with etcd.client() as c:
        yield c


@pytest.fixture
def name() -> str:
    """A semaphore name no other test uses."""
    return f"t-{uuid.uuid4().hex[:10]}"


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None once
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def etcd_metrics(cluster: EtcdCluster) -> list[str]:
    """The lines of etcd's first member's Prometheus metrics (``/metrics``) now."""
    import urllib.request

    url = f"http://{cluster.members[0].endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text.splitlines()


def etcd_watchers(cluster: EtcdCluster) -> int:
    """The watchers etcd's first member has registered now (``etcd_debugging_mvcc_watcher_total``):
    a watch counts once etcd has set it up."""
    for line in etcd_metrics(cluster):
        if line.startswith("etcd_debugging_mvcc_watcher_total "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no etcd_debugging_mvcc_watcher_total in etcd's metrics")


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def sema_keys(client: Client, name: str, max_holders: int | None = None) -> list[rpc_pb2.KeyValue]:
    from conch import keys

    prefix = keys.name_prefix(name) if max_holders is None else keys.sema_prefix(name, max_holders)
    response = kv.range_prefix(client, prefix, sort_target=kv.CREATE, sort_order=kv.ASCEND)
    return list(response.kvs)


@contextlib.contextmanager
def other_keys(client: Client, name: str, max_holders: int, count: int) -> Iterator[list[bytes]]:
    """``count`` keys queued under the semaphore by the test itself (on no lease), for a
    waiter to queue behind and the test to delete when it chooses; gone when the block ends.
    A waiter behind them holds on the look a deletion wakes it to, not on a window event."""
    from conch import keys

    others = [keys.sema_prefix(name, max_holders) + f"other-{i}".encode() for i in range(count)]
    for key in others:
        kv.put(client, key, b"{}")
    try:
        yield others
    finally:
        for key in others:
            kv.delete(client, key)


class Conch:
    """One ``python -m conch`` process; stderr goes to a file (no pipe to fill up)."""

    def __init__(
        self, args: list[str], env: dict[str, str], log_path: Path, launcher: Sequence[str] = ()
    ) -> None:
        self.args = args
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*launcher, sys.executable, "-m", "conch", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.process.wait(timeout=timeout)

    def stdout(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[str]:
        return [
            word.split("=", 1)[1]
            for line in self.log().splitlines()
            for word in line.split()
            if word.startswith("event=")
        ]

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Runner:
    """Starts conch processes against the test etcd and cleans them up."""

    def __init__(self, etcd: EtcdCluster, tmp_path: Path) -> None:
        self.etcd = etcd
        self.tmp_path = tmp_path
        self.started: list[Conch] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CONCH_ENDPOINTS=self.etcd.endpoints, CONCH_TTL="10s", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def start(self, *args: str, launcher: Sequence[str] = (), **env: str) -> Conch:
        """``launcher``: a command line that runs conch's (as its last arguments)."""
        log_path = self.tmp_path / f"conch-{len(self.started)}.log"
        proc = Conch(list(args), self.env(**env), log_path, launcher)
        self.started.append(proc)
        return proc

    def run(self, *args: str, timeout: float = DEADLINE, **env: str) -> tuple[int, str, str]:
        """Run to the end: (exit code, stdout, stderr)."""
        proc = self.start(*args, **env)
        code = proc.wait(timeout)
        return code, proc.stdout(), proc.log()

    def cleanup(self) -> None:
        # Shown by pytest only when the test failed.
        for proc in self.started:
            print(f"--- conch {' '.join(proc.args)} (exit {proc.process.poll()})\n{proc.log()}")
        for proc in self.started:
            if proc.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.process.wait()


@pytest.fixture
def conch(etcd: EtcdCluster, tmp_path: Path) -> Iterator[Runner]:
    runner = Runner(etcd, tmp_path)
    yield runner
    runner.cleanup()


class Gate:
    """A child command that records it runs, then holds its slot until released.

    ``cmd(id)`` is the child's argv: it puts ``running/<id>`` (containing CONCH_REV),
    waits until ``release/<id>`` exists, then removes its running file and exits. On
    SIGTERM it removes the running file and exits 143."""

    def __init__(self, base: Path) -> None:
        self.running = base / "running"
        self.release_dir = base / "release"
        self.started_log = base / "started.log"
        self.running.mkdir()
        self.release_dir.mkdir()

    def cmd(self, ident: str, code: int = 0) -> list[str]:
        script = (
            f"trap 'rm -f {self.running}/{ident}; exit 143' TERM; "
            # logged first, then the running file, written aside and renamed in: whoever
            # sees it running finds it in the log, and never finds the file empty
            f"echo {ident} >> {self.started_log}; "
            f'echo "$CONCH_REV" > {self.running}.{ident}; '
            f"mv {self.running}.{ident} {self.running}/{ident}; "
            f"while [ ! -e {self.release_dir}/{ident} ]; do sleep 0.02; done; "
            f"rm -f {self.running}/{ident}; exit {code}"
        )
        return ["sh", "-c", script]

    def release(self, ident: str) -> None:
        (self.release_dir / ident).touch()

    def now_running(self) -> set[str]:
        return {p.name for p in self.running.iterdir()}

    def start_order(self) -> list[str]:
        if not self.started_log.exists():
            return []
        return self.started_log.read_text().split()

    def rev(self, ident: str) -> int:
        return int((self.running / ident).read_text())


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    return Gate(tmp_path)


def who_json(runner: Runner, name: str, *extra: str) -> list[dict[str, object]]:
    code, out, _ = runner.run("sema", name, "--who", "--json", *extra)
    assert code in (0, 1)
    return [json.loads(line) for line in out.splitlines()]
