"""The framework recipes of examples/, each run by its real server against a real etcd:
FastAPI under uvicorn, Django (sync views under its test client and runserver, the ASGI
variant under uvicorn), Celery's prefork worker with a filesystem broker, gunicorn."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import conch
from conch.etcd import Client
from tests.conftest import poll, sema_keys
from tests.etcd_server import EtcdCluster, free_port

ROOT = Path(__file__).resolve().parents[2]


class Served:
    """A server process (its argv) on a free loopback port, its output in a file."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log: Path, port: int) -> None:
        self.port = port
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        poll(self.listening, timeout=60, what=f"{argv[2]} listening")

    def listening(self) -> bool:
        assert self.process.poll() is None, self.log.read_text(errors="replace")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def request(self, path: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        return sock

    def get(self, path: str) -> tuple[int, dict[str, str], str]:
        return parse(answer(self.request(path)))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        os.killpg(self.process.pid, sig)
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        print(self.log.read_text(errors="replace"))  # shown when the test failed


def answer(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], str]:
    head, _, body = raw.decode(errors="replace").partition("\r\n\r\n")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1]) if lines[0] else 0
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        chunks, rest = [], body
        while rest:
            size, _, rest = rest.partition("\r\n")
            length = int(size, 16)
            chunks.append(rest[:length])
            rest = rest[length + 2 :] if length else ""
        body = "".join(chunks)
    return status, headers, body


def example_env(etcd: EtcdCluster, name: str, **extra: str) -> dict[str, str]:
    return {
        "CONCH_ENDPOINTS": etcd.endpoints,
        "CONCH_EXAMPLE_NAME": name,
        "CONCH_EXAMPLE_MAX": "1",
        "CONCH_EXAMPLE_JOB": "0.05",
        **extra,
    }


def uvicorn(target: str, env: dict[str, str], log: Path, lifespan: str = "on") -> Served:
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--http", "h11", "--lifespan", lifespan]
    argv += ["--timeout-graceful-shutdown", "1", "--log-level", "warning"]
    return Served(argv, env, log, port)


# -- FastAPI ---------------------------------------------------------------------------


@pytest.fixture
def fastapi_server(etcd: EtcdCluster, name: str, tmp_path: Path) -> Iterator[Served]:
    served = uvicorn(
        "examples.fastapi_app:app",
        example_env(etcd, name, CONCH_EXAMPLE_WAIT="30"),
        tmp_path / "uvicorn.log",
    )
    yield served
    served.kill()


def test_fastapi_answers_with_the_fencing_token(fastapi_server: Served, name: str) -> None:
    status, _, body = fastapi_server.get("/call")
    assert status == 200, body
    assert json.loads(body)["token"] > 0


def test_fastapi_answers_503_on_no_slot(
    etcd: EtcdCluster, client: Client, name: str, tmp_path: Path
) -> None:
    served = uvicorn(
        "examples.fastapi_app:app",
        example_env(etcd, name, CONCH_EXAMPLE_WAIT="0.3"),
        tmp_path / "uvicorn.log",
    )
    try:
        with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
            status, headers, body = served.get("/call")
        assert status == 503 and headers["retry-after"] == "1", body
        assert "no slot in time" in body
        assert len(sema_keys(client, name, 1)) == 0
    finally:
        served.kill()


def test_fastapi_withdraws_a_request_whose_client_disconnects(
    fastapi_server: Served, client: Client, name: str
) -> None:
    with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
        socks = [fastapi_server.request("/call") for _ in range(4)]
        poll(lambda: len(sema_keys(client, name, 1)) == 5, what="every request queued")
        for sock in socks[2:]:
            sock.close()
        poll(lambda: len(sema_keys(client, name, 1)) == 3, what="the two abandoned withdrawn")
    statuses = [parse(answer(sock))[0] for sock in socks[:2]]
    assert statuses == [200, 200]
    poll(lambda: sema_keys(client, name, 1) == [], what="nothing left")


def test_fastapi_answers_503_to_queued_requests_on_shutdown_and_leaves_no_key(
    fastapi_server: Served, client: Client, name: str
) -> None:
    """uvicorn --timeout-graceful-shutdown 1, 10 requests queued behind a slot held
    elsewhere: SIGTERM; each gets a 503 (not uvicorn's 500) and its key is withdrawn."""
    with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
        socks = [fastapi_server.request("/call") for _ in range(10)]
        poll(lambda: len(sema_keys(client, name, 1)) == 11, what="every request queued")
        started = time.monotonic()
        code = fastapi_server.stop()
        took = time.monotonic() - started
        answers = [parse(answer(sock)) for sock in socks]
        assert [status for status, _, _ in answers] == [503] * 10, answers
        assert all(body == "shutting down\n" for _, _, body in answers)
        assert len(sema_keys(client, name, 1)) == 1  # ours only
    assert code in (0, -signal.SIGTERM)
    assert took < 20
    assert "Exception in ASGI application" not in fastapi_server.log.read_text()


# -- Django ----------------------------------------------------------------------------


def test_django_sync_view_answers_the_token_and_503_on_no_slot(
    etcd: EtcdCluster, client: Client, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in example_env(etcd, name, CONCH_EXAMPLE_WAIT="0.3").items():
        monkeypatch.setenv(key, value)
    from django.test import Client as DjangoClient

    import examples.django_app  # noqa: F401  (configures Django)

    browser = DjangoClient()
    ok = browser.get("/call")
    assert ok.status_code == 200 and json.loads(ok.content)["token"] > 0
    with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
        busy = browser.get("/call")
    assert busy.status_code == 503 and busy["Retry-After"] == "1"
    assert sema_keys(client, name, 1) == []


def test_django_runserver_serves_the_sync_view(
    etcd: EtcdCluster, name: str, tmp_path: Path
) -> None:
    port = free_port()
    argv = [sys.executable, "examples/django_app.py", "runserver", "--noreload", str(port)]
    served = Served(argv, example_env(etcd, name), tmp_path / "runserver.log", port)
    try:
        status, _, body = served.get("/call")
        assert status == 200 and json.loads(body)["token"] > 0, body
    finally:
        served.kill()


def test_django_asgi_view_withdraws_a_request_whose_client_disconnects(
    etcd: EtcdCluster, client: Client, name: str, tmp_path: Path
) -> None:
    served = uvicorn(
        "examples.django_app:asgi_app",
        example_env(etcd, name, CONCH_EXAMPLE_WAIT="30"),
        tmp_path / "uvicorn.log",
        lifespan="off",  # Django's ASGI handler has no lifespan
    )
    try:
        status, _, body = served.get("/acall")
        assert status == 200 and json.loads(body)["token"] > 0, body
        with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
            socks = [served.request("/acall") for _ in range(3)]
            poll(lambda: len(sema_keys(client, name, 1)) == 4, what="every request queued")
            socks[2].close()
            poll(lambda: len(sema_keys(client, name, 1)) == 3, what="the abandoned withdrawn")
        assert [parse(answer(sock))[0] for sock in socks[:2]] == [200, 200]
        poll(lambda: sema_keys(client, name, 1) == [], what="nothing left")
    finally:
        served.kill()


# -- Celery ----------------------------------------------------------------------------


def test_celery_prefork_workers_hold_at_most_max_slots(
    etcd: EtcdCluster, client: Client, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefork worker of 3 processes (each connects in worker_process_init), 8 tasks on
    one slot: every task ran, one at a time, each with its own rising fencing token."""
    journal = tmp_path / "journal"
    env = example_env(
        etcd,
        name,
        CONCH_EXAMPLE_BROKER_DIR=str(tmp_path / "broker"),
        CONCH_EXAMPLE_JOURNAL=str(journal),
        CONCH_EXAMPLE_WAIT="30",
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [sys.executable, "-m", "celery", "-A", "examples.celery_app", "worker"]
    argv += ["--pool", "prefork", "--concurrency", "3", "--loglevel", "warning"]
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        import examples.celery_app as tasks

        results = [tasks.call_backend.delay(str(i)) for i in range(8)]
        tokens = [result.get(timeout=120) for result in results]
        assert len(set(tokens)) == 8
        lines = [line.split() for line in journal.read_text().splitlines()]
        assert len(lines) == 16
        inside = 0
        for _, what, _, _ in sorted(lines, key=lambda line: float(line[0])):
            inside += 1 if what == "start" else -1
            assert inside in (0, 1), lines
        in_order = sorted(lines, key=lambda line: float(line[0]))
        starts = [int(rev) for _, what, _, rev in in_order if what == "start"]
        assert starts == sorted(starts)  # one slot: each holder's token above the last
        assert sema_keys(client, name, 1) == []
    finally:
        # The worker's main process alone: its warm shutdown stops the pool processes, each
        # closing its client (worker_process_shutdown). A SIGTERM to the whole group killed
        # the pool processes under the main one, which then sat out the 60 s below at times.
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        print(log.read_text(errors="replace"))


# -- gunicorn --------------------------------------------------------------------------


def test_gunicorn_preloaded_workers_each_connect_their_own_client(
    etcd: EtcdCluster, client: Client, name: str, tmp_path: Path
) -> None:
    """gunicorn --preload, 3 sync workers (examples/gunicorn_conf.py): the workers serve
    (a worker on the master's client would raise at once), NoSlot is a 503, and a graceful
    stop leaves no key."""
    port = free_port()
    argv = [sys.executable, "-m", "gunicorn", "-c", "examples/gunicorn_conf.py"]
    argv += ["examples.django_app:wsgi_app"]
    env = example_env(etcd, name, CONCH_EXAMPLE_BIND=f"127.0.0.1:{port}", CONCH_EXAMPLE_WAIT="0.3")
    served = Served(argv, env, tmp_path / "gunicorn.log", port)
    try:
        answers = [served.get("/call") for _ in range(12)]
        assert all(status == 200 for status, _, _ in answers), answers
        assert len({json.loads(body)["token"] for _, _, body in answers}) == 12
        with conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10):
            status, headers, _ = served.get("/call")
        assert status == 503 and headers["retry-after"] == "1"
        assert served.stop() == 0
        assert sema_keys(client, name, 1) == []
    finally:
        served.kill()
