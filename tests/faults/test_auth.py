"""etcd authentication under churn: JWT tokens that go stale at every auth change, and simple
tokens lost when the one member a client talks to restarts. Real etcd; users and roles made
by etcdctl, key pairs by the openssl command."""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conchpb.authpb import auth_pb2
from conchpb.etcdserverpb import rpc_pb2

from conch.errors import EtcdError
from conch.etcd import Client, Endpoint, kv
from conch.etcd.client import Credentials
from conch.etcd.watch import Watch, WatchNotice
from tests.conftest import DEADLINE, Gate, Runner, etcd_metrics, etcd_watchers, poll, sema_keys
from tests.etcd_server import EtcdCluster
from tests.faults.test_security import PASSWORD, etcdctl, openssl

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

ROOT = Credentials("root", "rootpw")


def enable_auth(cluster: EtcdCluster) -> None:
    """root, and ``alice`` who may read and write /conch/v1/sema/ only; then auth on."""
    etcdctl(cluster, "user", "add", "root:rootpw", user=None)
    etcdctl(cluster, "user", "grant-role", "root", "root", user=None)
    etcdctl(cluster, "role", "add", "conch", user=None)
    etcdctl(
        cluster,
        "role",
        "grant-permission",
        "conch",
        "readwrite",
        "/conch/v1/sema/",
        "--prefix=true",
        user=None,
    )
    etcdctl(cluster, "user", "add", f"alice:{PASSWORD}", user=None)
    etcdctl(cluster, "user", "grant-role", "alice", "conch", user=None)
    etcdctl(cluster, "auth", "enable", user=None)


def root_client(cluster: EtcdCluster) -> Client:
    endpoints = [Endpoint.parse(e) for e in cluster.endpoints.split(",")]
    return Client.connect(endpoints, credentials=ROOT)


@pytest.fixture(scope="module")
def jwt_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One member issuing RS256 JWT tokens (5 s), which carry the auth revision they were
    issued at: any user or role change makes every token issued before it stale."""
    base = tmp_path_factory.mktemp("jwt")
    openssl("genrsa", "-out", "jwt.key", "2048", cwd=base)
    openssl("rsa", "-in", "jwt.key", "-pubout", "-out", "jwt.pub", cwd=base)
    token = f"jwt,pub-key={base}/jwt.pub,priv-key={base}/jwt.key,sign-method=RS256,ttl=5s"
    # A cheap password hash: etcd checks it at every Authenticate, and retries one whose
    # check an auth change overtook, so a slow hash would let the churn starve every login.
    cluster = EtcdCluster(base / "etcd", extra=[f"--auth-token={token}", "--bcrypt-cost=4"])
    cluster.start()
    enable_auth(cluster)
    yield cluster
    cluster.stop()


@contextlib.contextmanager
def auth_churn(cluster: EtcdCluster, pause: float = 0.01) -> Iterator[list[int]]:
    """A thread bumping the auth revision every ``pause`` seconds while the block runs;
    yields a one-item list counting the bumps."""
    done = threading.Event()
    bumps = [0]

    # Granting a permission the role has already changes nothing but the auth revision.
    grant = rpc_pb2.AuthRoleGrantPermissionRequest(
        name="conch",
        perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=b"/churn/"),
    )

    def churn() -> None:
        with root_client(cluster) as client:
            while not done.wait(pause):
                with contextlib.suppress(EtcdError):  # its own token goes stale too
                    client.call("auth", "RoleGrantPermission", grant)
                    bumps[0] += 1

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield bumps
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)


@pytest.mark.alone
def test_runs_and_releases_keep_up_with_auth_changes(
    jwt_etcd: EtcdCluster, tmp_path: Path, name: str
) -> None:
    runner = Runner(jwt_etcd, tmp_path)
    env = {"CONCH_USER": "alice", "CONCH_PASSWORD": PASSWORD, "CONCH_TTL": "5s"}
    try:
        with auth_churn(jwt_etcd) as bumps:
            procs = [
                runner.start("sema", name, "--max", "2", "--", "sleep", "0.3", **env)
                for _ in range(6)
            ]
            codes = [proc.wait() for proc in procs]
        logs = [proc.log() for proc in procs]
        assert codes == [0] * 6, logs
        assert bumps[0] > 20  # many auth changes during the runs
        for log in logs:
            assert "revoke-failed" not in log and "revoked=True" in log, log
        with root_client(jwt_etcd) as client:
            assert sema_keys(client, name) == []
    finally:
        runner.cleanup()


def answered_watchers(cluster: EtcdCluster) -> int | None:
    """``etcd_watchers(cluster)``, or None while its first member does not answer."""
    with contextlib.suppress(OSError):
        return etcd_watchers(cluster)
    return None


def test_waiters_on_one_member_outlive_its_restart(tmp_path: Path, name: str) -> None:
    """Simple tokens live in each member's memory: a member that restarts from a snapshot
    refuses connections while down, then has forgotten every token it issued (invalid auth
    token). Waiters given only its endpoint must ride both out, never exit 69."""
    # A small snapshot count: without a snapshot the member replays the Authenticate
    # entries of its log on restart and so remembers the tokens, unlike a long-lived one.
    extra = ["--auth-token=simple", "--auth-token-ttl=2", "--snapshot-count=5"]
    cluster = EtcdCluster(tmp_path / "etcd", size=3, extra=extra)
    runner = Runner(cluster, tmp_path)
    gate = Gate(tmp_path)
    # A dial timeout for a loaded machine: ten processes authenticating at once beside the
    # rest of the suite once all exited 69 at the default 5 s, before any fault.
    env = {
        "CONCH_USER": "alice",
        "CONCH_PASSWORD": PASSWORD,
        "CONCH_TTL": "10s",
        "CONCH_DIAL_TIMEOUT": "30s",
    }
    restarted = cluster.members[0]
    try:
        cluster.start()
        enable_auth(cluster)
        # the holder on the other members: the restarted one's watchers are the waiters'
        others = ",".join(m.endpoint for m in cluster.members[1:])
        holder = runner.start(
            "sema", name, "--max", "1", "--", *gate.cmd("h"), CONCH_ENDPOINTS=others, **env
        )
        poll(lambda: gate.now_running() == {"h"}, what="holder")
        one = {"CONCH_ENDPOINTS": restarted.endpoint, **env}
        waiters = [
            runner.start("sema", name, "--max", "1", "--", *gate.cmd(f"w{i}"), **one)
            for i in range(10)
        ]
        # ten processes starting and authenticating (bcrypt at etcd's default cost) beside
        # the rest of the suite: a wait for an event, so a bound for a loaded machine
        poll(
            lambda: all("event=queued" in w.log() for w in waiters),
            timeout=3 * DEADLINE,
            what="waiters queued",
        )
        restarted.kill()
        time.sleep(3)  # the outage the waiters must ride out
        restarted.start(cluster.initial_cluster)
        # Each waiter watches again through the restarted member: it met its forgotten
        # token (its watch and reads refused) and authenticated again.
        poll(
            lambda: answered_watchers(cluster) == 10,
            timeout=3 * DEADLINE,
            what="the ten waiters watching through the restarted member",
        )
        # The member must be back: a restart that failed would leave the waiters nothing to
        # reach (seen once on a loaded machine: refused connections to the end).
        assert restarted.process is not None and restarted.process.poll() is None, (
            restarted.log_path.read_text(errors="replace")[-3000:]
        )
        assert [w.process.poll() for w in waiters] == [None] * 10, [w.log() for w in waiters]
        for ident in ["h"] + [f"w{i}" for i in range(10)]:
            gate.release(ident)
        codes = [holder.wait(), *(w.wait(timeout=60) for w in waiters)]
        assert codes == [0] * 11, [w.log() for w in waiters if w.process.returncode]
        assert sorted(gate.start_order()) == sorted(["h"] + [f"w{i}" for i in range(10)])
        with root_client(cluster) as client:
            assert sema_keys(client, name) == []
    finally:
        runner.cleanup()
        cluster.stop()


def alice(cluster: EtcdCluster) -> Client:
    endpoints = [Endpoint.parse(e) for e in cluster.endpoints.split(",")]
    return Client.connect(endpoints, credentials=Credentials("alice", PASSWORD))


def bump_auth_revision(cluster: EtcdCluster) -> None:
    with auth_churn(cluster, pause=0.0) as bumps:
        poll(lambda: bumps[0] >= 1, what="an auth change")


def test_a_watch_opened_with_a_stale_token_starts_with_a_fresh_one(
    jwt_etcd: EtcdCluster, name: str
) -> None:
    key = f"/conch/v1/sema/{name}".encode()
    notices: queue.SimpleQueue[WatchNotice] = queue.SimpleQueue()
    with alice(jwt_etcd) as client:
        bump_auth_revision(jwt_etcd)  # etcd cancels a watch created with the token we hold
        watch = Watch(client, key, 0, notices.put, confirm=True)
        try:
            notice = notices.get(timeout=10)
            assert notice.error is None and notice.created, notice.error
            kv.put(client, key, b"x")
            notice = notices.get(timeout=10)
            assert notice.error is None and [e.kv.key for e in notice.events] == [key]
        finally:
            watch.cancel()
            kv.delete(client, key)


def authenticate_calls(cluster: EtcdCluster) -> int:
    """Auth.Authenticate calls the member has answered, from its Prometheus metrics."""
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in etcd_metrics(cluster)
        if line.startswith("grpc_server_handled_total{") and 'grpc_method="Authenticate"' in line
    )


def test_threads_that_meet_a_stale_token_share_one_fresh_token(
    jwt_etcd: EtcdCluster, name: str
) -> None:
    key = f"/conch/v1/sema/{name}".encode()
    threads = 16
    start = threading.Barrier(threads)
    failures: list[BaseException] = []

    def read() -> None:
        start.wait(timeout=10)
        try:
            kv.get(client, key)
        except BaseException as exc:
            failures.append(exc)

    with alice(jwt_etcd) as client:
        bump_auth_revision(jwt_etcd)  # the token every thread sends first is stale
        before = authenticate_calls(jwt_etcd)
        readers = [threading.Thread(target=read) for _ in range(threads)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=30)
        assert failures == []
        assert authenticate_calls(jwt_etcd) - before == 1
