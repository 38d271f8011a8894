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

ROOT = Path(__file__).resolve().parent.parent


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
    return status, headers, body


def example_env(etcd: EtcdCluster, name: str, **extra: str) -> dict[str, str]:
    return {
        "CONCH_ENDPOINTS": etcd.endpoints,
        "CONCH_EXAMPLE_NAME": name,
        "CONCH_EXAMPLE_MAX": "1",
        "CONCH_EXAMPLE_JOB": "0.05",
        **extra,
    }


def uvicorn(target: str, env: dict[str, str], log: Path) -> Served:
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--http", "h11", "--lifespan", "on"]
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
