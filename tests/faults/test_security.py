"""TLS, mutual TLS and etcd authentication against real etcd servers. Certificates are made
by the openssl command; users and roles by etcdctl."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conch.etcd import Client
from conch.etcd.client import TLS
from tests.conftest import Gate, Runner, poll
from tests.etcd_server import EtcdCluster, etcdctl_binary

Result = tuple[int, str, str]

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

PASSWORD = "s3cret-Pa55"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


def make_cert(d: Path, ca: str, name: str, san: str) -> None:
    (d / f"{name}.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=d,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


def make_pki(d: Path) -> Path:
    """In ``d``: two CAs ("ca", "other-ca"), and a server (127.0.0.1, localhost) and a
    client certificate signed by "ca"; returns ``d``."""
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "ca", "server", "IP:127.0.0.1,DNS:localhost")
    make_cert(d, "ca", "client", "DNS:conch-client")
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_cluster(base: Path, pki: Path, mutual: bool) -> EtcdCluster:
    extra = [f"--cert-file={pki}/server.pem", f"--key-file={pki}/server.key"]
    if mutual:
        extra += ["--client-cert-auth", f"--trusted-ca-file={pki}/ca.pem"]
    cluster = EtcdCluster(base, size=1, extra=extra, tls=client_tls(pki))
    cluster.start()
    return cluster


def client_tls(pki: Path) -> TLS:
    return TLS(
        cacert=(pki / "ca.pem").read_bytes(),
        cert=(pki / "client.pem").read_bytes(),
        key=(pki / "client.key").read_bytes(),
    )


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[EtcdCluster]:
    cluster = tls_cluster(tmp_path_factory.mktemp("tls"), pki, mutual=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def mtls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[EtcdCluster]:
    cluster = tls_cluster(tmp_path_factory.mktemp("mtls"), pki, mutual=True)
    yield cluster
    cluster.stop()


def run_tls(cluster: EtcdCluster, tmp_path: Path, *flags: str, cmd: str = "true") -> Result:
    """``conch sema tls --max 1`` against ``cluster`` with ``flags``, running ``cmd``."""
    base = ("sema", "tls", "--max", "1", "--endpoints", cluster.endpoints)
    return Runner(cluster, tmp_path).run(*base, *flags, "--", *cmd.split())


def test_server_tls_with_our_ca(tls_etcd: EtcdCluster, pki: Path, tmp_path: Path) -> None:
    # a bundle as Mozilla's are: comments in UTF-8 between the certificates
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes("# Issuer: CN=Főtanúsítvány\n".encode() + (pki / "ca.pem").read_bytes())
    for cacert in (pki / "ca.pem", bundle):
        code, out, err = run_tls(tls_etcd, tmp_path, "--cacert", str(cacert), cmd="echo inside")
        assert code == 0, err
        assert out.strip() == "inside"


def test_wrong_ca_is_a_clear_error_and_exit_69(
    tls_etcd: EtcdCluster, pki: Path, tmp_path: Path
) -> None:
    ca = str(pki / "other-ca.pem")
    code, _, err = run_tls(tls_etcd, tmp_path, "--cacert", ca, "--dial-timeout", "2s")
    assert code == 69
    assert "Traceback" not in err and "cannot reach etcd" in err


def test_unusable_certificate_files_are_usage_errors_at_once(
    tls_etcd: EtcdCluster, pki: Path, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    runner = Runner(tls_etcd, tmp_path)
    for flags in (
        ["--cacert", str(junk)],
        ["--cacert", str(pki / "ca.pem"), "--cert", str(junk), "--key", str(junk)],
        ["--cacert", str(pki / "ca.pem"), "--cert", str(pki / "client.pem"), "--key", str(junk)],
    ):
        began = time.monotonic()
        code, _, err = runner.run(
            "sema", "tls", "--max", "1", "--endpoints", tls_etcd.endpoints, *flags, "--", "true"
        )
        assert code == 64, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("conch: bad --"), err  # no gRPC noise
        assert time.monotonic() - began < 4.0  # not a dial that times out (default 5 s)


def test_mutual_tls_needs_the_client_certificate(
    mtls_etcd: EtcdCluster, pki: Path, tmp_path: Path
) -> None:
    runner = Runner(mtls_etcd, tmp_path)
    base = [
        "sema",
        "mtls",
        "--max",
        "1",
        "--endpoints",
        mtls_etcd.endpoints,
        "--cacert",
        str(pki / "ca.pem"),
        "--dial-timeout",
        "2s",
    ]
    code, _, err = runner.run(
        *base, "--cert", str(pki / "client.pem"), "--key", str(pki / "client.key"), "--", "true"
    )
    assert code == 0, err
    code, _, err = runner.run(*base, "--", "true")
    assert code == 69 and "Traceback" not in err


def run_skip_verify(cluster: EtcdCluster, tmp_path: Path, *flags: str) -> None:
    """``conch --insecure-skip-tls-verify FLAGS`` runs its command against ``cluster``."""
    code, out, err = Runner(cluster, tmp_path).run(
        *["sema", "skip", "--max", "1", "--endpoints", cluster.endpoints],
        *["--insecure-skip-tls-verify", *flags, "--dial-timeout", "3s"],
        *["--", "echo", "inside"],
    )
    assert code == 0, err
    assert out.strip() == "inside"


def test_insecure_skip_tls_verify_connects_without_the_ca(
    tls_etcd: EtcdCluster, tmp_path: Path
) -> None:
    run_skip_verify(tls_etcd, tmp_path)


def test_insecure_skip_tls_verify_with_a_client_certificate(
    mtls_etcd: EtcdCluster, pki: Path, tmp_path: Path
) -> None:
    """Against an etcd that requires client certificates, skip-verify must show ours while
    it fetches the server's certificate, or the handshake is refused."""
    run_skip_verify(
        mtls_etcd, tmp_path, "--cert", str(pki / "client.pem"), "--key", str(pki / "client.key")
    )


def test_missing_certificate_file_is_a_usage_error(tls_etcd: EtcdCluster, tmp_path: Path) -> None:
    runner = Runner(tls_etcd, tmp_path)
    code, _, err = runner.run(
        "sema",
        "x",
        "--max",
        "1",
        "--endpoints",
        tls_etcd.endpoints,
        "--cacert",
        str(tmp_path / "nope.pem"),
        "--",
        "true",
    )
    assert code == 64
    assert "--cacert" in err and "nope.pem" in err


# -- etcd authentication -------------------------------------------------------------------


def etcdctl(cluster: EtcdCluster, *args: str, user: str | None = "root:rootpw") -> None:
    cmd = [etcdctl_binary(), "--endpoints", cluster.endpoints]
    if user:
        cmd += ["--user", user]
    subprocess.run([*cmd, *args], check=True, capture_output=True, timeout=60)


TOKEN_TTL = 2  # auth_etcd's simple tokens: seconds after their last use


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Auth enabled, simple tokens that expire after 2 s; ``alice`` may read and write
    /conch/v1/sema/ and nothing else; ``mallory`` only /elsewhere/."""
    cluster = EtcdCluster(
        tmp_path_factory.mktemp("auth"),
        size=1,
        extra=["--auth-token=simple", f"--auth-token-ttl={TOKEN_TTL}"],
    )
    cluster.start()
    etcdctl(cluster, "user", "add", "root:rootpw", user=None)
    etcdctl(cluster, "user", "grant-role", "root", "root", user=None)
    for user, role, prefix in (
        ("alice", "conch", "/conch/v1/sema/"),
        ("mallory", "other", "/elsewhere/"),
    ):
        etcdctl(cluster, "role", "add", role, user=None)
        etcdctl(
            cluster,
            "role",
            "grant-permission",
            role,
            "readwrite",
            prefix,
            "--prefix=true",
            user=None,
        )
        etcdctl(cluster, "user", "add", f"{user}:{PASSWORD}", user=None)
        etcdctl(cluster, "user", "grant-role", user, role, user=None)
    etcdctl(cluster, "auth", "enable", user=None)
    yield cluster
    cluster.stop()


def test_least_privilege_user_runs_and_lists(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    runner = Runner(auth_etcd, tmp_path)
    code, _, err = runner.run(
        "sema", "auth-run", "--max", "1", "--user", "alice", "--", "true", CONCH_PASSWORD=PASSWORD
    )
    assert code == 0, err
    assert PASSWORD not in err
    code, out, err = runner.run("sema", "auth-run", "--who", "--user", f"alice:{PASSWORD}")
    assert code == 1 and out == "", err


def test_password_from_a_file_never_shows(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    runner = Runner(auth_etcd, tmp_path)
    gate = Gate(tmp_path)
    proc = runner.start(
        "sema",
        "auth-file",
        "--max",
        "1",
        "--user",
        "alice",
        "--password-file",
        str(secret),
        "--",
        *gate.cmd("h"),
    )
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    code, out, _ = runner.run(
        "sema", "auth-file", "--who", "--json", "--user", "alice", "--password-file", str(secret)
    )
    assert code == 0 and PASSWORD not in out and '"state": "HELD"' in out
    gate.release("h")
    assert proc.wait() == 0
    assert PASSWORD not in proc.log()


def test_wrong_password_exits_64_without_echoing_it(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    runner = Runner(auth_etcd, tmp_path)
    code, _, err = runner.run(
        "sema", "x", "--max", "1", "--user", "alice:Wr0ng-guess", "--", "true"
    )
    assert code == 64
    assert "authentication failed" in err and "Wr0ng-guess" not in err


def test_a_password_flag_beats_the_password_env_var(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    runner = Runner(auth_etcd, tmp_path)
    for flags in (["--password-file", str(secret)], ["--password", PASSWORD]):
        code, out, err = runner.run(
            "sema",
            "x",
            "--max",
            "1",
            "--user",
            "alice",
            *flags,
            "--",
            "echo",
            "ran",
            CONCH_PASSWORD="Wr0ng-guess",
        )
        assert (code, out) == (0, "ran\n"), err


def test_a_user_given_to_a_cluster_without_auth_is_a_usage_error(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    code, _, err = Runner(etcd, tmp_path).run(
        "sema", "x", "--max", "1", "--user", "bob:pw", "--", "true"
    )
    assert code == 64, err
    assert "authentication is not enabled" in err and "cannot reach" not in err


def test_permission_denied_is_a_clear_error_and_exit_69(
    auth_etcd: EtcdCluster, tmp_path: Path
) -> None:
    runner = Runner(auth_etcd, tmp_path)
    code, _, err = runner.run(
        "sema", "x", "--max", "1", "--user", "mallory", "--", "true", CONCH_PASSWORD=PASSWORD
    )
    assert code == 69
    assert "permission denied" in err and "Traceback" not in err


def test_hold_and_wait_outlive_their_tokens(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    """The holder and the waiter, idle past their tokens' lifetime, release and take the
    slot with tokens authenticated again."""
    runner = Runner(auth_etcd, tmp_path)
    gate = Gate(tmp_path)
    env = {"CONCH_USER": "alice", "CONCH_PASSWORD": PASSWORD, "CONCH_TTL": "3s"}
    holder = runner.start("sema", "auth-long", "--max", "1", "--", *gate.cmd("h"), **env)
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    waiter = runner.start("sema", "auth-long", "--max", "1", "--", *gate.cmd("w"), **env)
    poll(lambda: "event=queued" in waiter.log(), what="waiter queued")
    # Observation window: one token lifetime, etcd's 1 s sweep of expired tokens and a
    # second's margin (the waiter's last call may follow its queued line): the tokens both
    # were given are gone (keepalives carry none).
    time.sleep(TOKEN_TTL + 2)
    assert gate.now_running() == {"h"}
    gate.release("h")
    poll(lambda: gate.now_running() == {"w"}, what="waiter promoted with a renewed token")
    gate.release("w")
    assert holder.wait() == 0 and waiter.wait() == 0
    for log in (holder.log(), waiter.log()):
        assert "event=lost" not in log and "revoked=True" in log, log


def test_no_credential_reaches_the_child_or_the_watchdog(
    auth_etcd: EtcdCluster, tmp_path: Path
) -> None:
    """The etcd password, however conch or etcdctl was given it, is in neither the child's
    environment nor the watchdog's (/proc/PID/environ): every job a cron line wraps could
    read the cluster's credentials."""
    runner = Runner(auth_etcd, tmp_path)
    gate = Gate(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(PASSWORD + "\n")
    env = {
        "CONCH_USER": "alice",
        "CONCH_PASSWORD": PASSWORD,
        "CONCH_PASSWORD_FILE": str(secret),
        "ETCDCTL_USER": f"alice:{PASSWORD}",
        "ETCDCTL_PASSWORD": PASSWORD,
    }
    envfile = tmp_path / "child-env"
    script = f"cat /proc/$$/environ > {envfile}; " + gate.cmd("h")[2]
    holder = runner.start("sema", "auth-env", "--max", "1", "--", "sh", "-c", script, **env)
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    watchdogs = [
        int(pid)
        for children in Path(f"/proc/{holder.pid}/task").glob("*/children")
        for pid in children.read_text().split()
        if b"_watchdog_main.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(watchdogs) == 1
    environs = {
        "child": envfile.read_bytes(),
        "watchdog": Path(f"/proc/{watchdogs[0]}/environ").read_bytes(),
    }
    gate.release("h")
    assert holder.wait() == 0, holder.log()
    for who, environ in environs.items():
        assert PASSWORD.encode() not in environ, f"the password is in the {who}'s environment"
        names = {entry.split(b"=", 1)[0] for entry in environ.split(b"\0")}
        assert not names & {name.encode() for name in env}, who
        assert b"CONCH_REV" in names or who == "watchdog"


def test_supervise_starts_the_child_from_the_environment_it_is_given(
    client: Client, name: str, tmp_path: Path
) -> None:
    """``supervise(environ=...)``: the environment the child starts from (the command passes
    the operator's, before its own settings), less conch's credentials."""
    from conch.flag import Flag
    from conch.semaphore import Semaphore
    from conch.supervisor import supervise

    envfile = tmp_path / "env"
    environ = {"PATH": "/usr/bin:/bin", "GIVEN": "yes", "CONCH_PASSWORD": PASSWORD}
    # Paths to secrets go as the secrets do; the CA bundle, no secret, is passed on.
    paths = ("CONCH_PASSWORD_FILE", "CONCH_CERT", "CONCH_KEY", "ETCDCTL_CERT", "ETCDCTL_KEY")
    environ.update({path: f"/etc/conch/{path.lower()}" for path in paths})
    environ["CONCH_CACERT"] = "/etc/conch/ca.pem"
    sema = Semaphore(client, name, 1, 5)
    cmd = ["sh", "-c", f"env > {envfile}"]
    assert supervise(sema, cmd, None, 1.0, Flag("stop"), environ=environ) == 0
    names = {line.split("=", 1)[0] for line in envfile.read_text().splitlines()}
    assert {"GIVEN", "CONCH_REV"} <= names
    assert "CONCH_PASSWORD" not in names and "HOME" not in names
    assert not names & set(paths)
    assert "CONCH_CACERT" in names
