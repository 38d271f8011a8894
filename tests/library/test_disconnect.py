"""A web request whose client goes away while it is queued (examples/asgi_disconnect.py).

uvicorn, on a free loopback port, serves the example app; the test holds the slot itself,
queues 20 requests behind it, closes 10 of their connections while they wait, then releases
the slot. With the pattern (``/job``: the acquire raced against ``http.disconnect``) the 10
abandoned requests withdraw their keys at once and never run; without it (``/job-naive``)
uvicorn lets their handlers go on, and they take the slot in turn and run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import conch
from conch.etcd import Client
from tests.conftest import poll, sema_keys
from tests.etcd_server import EtcdCluster, free_port

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, ABANDONED = 20, 10


class Server:
    """uvicorn serving examples/asgi_disconnect.py, in a process of its own."""

    def __init__(self, etcd: EtcdCluster, name: str, ran: Path, log: Path) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            CONCH_ENDPOINTS=etcd.endpoints,
            CONCH_EXAMPLE_NAME=name,
            CONCH_EXAMPLE_MAX="1",
            CONCH_EXAMPLE_JOB="0.05",
            CONCH_EXAMPLE_RAN=str(ran),
        )
        argv = [sys.executable, "-m", "uvicorn", "examples.asgi_disconnect:app"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--http", "h11"]
        argv += ["--lifespan", "on", "--log-level", "warning"]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True
            )
        poll(self.listening, what="uvicorn listening")

    def listening(self) -> bool:
        assert self.process.poll() is None, "uvicorn exited"
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def request(self, path: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        return sock

    def stop(self) -> None:
        """SIGTERM: uvicorn's graceful shutdown (lifespan shutdown closes the conch client),
        after which it re-raises the signal."""
        os.killpg(self.process.pid, signal.SIGTERM)
        assert self.process.wait(timeout=30) in (0, -signal.SIGTERM)


@pytest.fixture
def server(etcd: EtcdCluster, name: str, tmp_path: Path) -> Iterator[Server]:
    served = Server(etcd, name, tmp_path / "ran", tmp_path / "uvicorn.log")
    yield served
    if served.process.poll() is None:
        os.killpg(served.process.pid, signal.SIGKILL)
        served.process.wait()
    print((tmp_path / "uvicorn.log").read_text(errors="replace"))  # shown when failing


def answer(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def abandon_half(server: Server, client: Client, name: str, path: str) -> list[str]:
    """Hold the slot, queue REQUESTS requests on ``path``, close the connections of the
    last ABANDONED while they wait, release; return what each kept request answered."""
    hold = conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10)
    socks = [server.request(f"{path}?id={i}") for i in range(REQUESTS)]
    poll(lambda: len(sema_keys(client, name, 1)) == 1 + REQUESTS, what="every request queued")
    for sock in socks[REQUESTS - ABANDONED :]:
        sock.close()
    if path == "/job":  # withdrawn on the disconnect, not at their turn
        poll(
            lambda: len(sema_keys(client, name, 1)) == 1 + REQUESTS - ABANDONED,
            what="the abandoned requests' keys withdrawn",
        )
    hold.release()
    return [answer(sock).decode() for sock in socks[: REQUESTS - ABANDONED]]


def test_requests_abandoned_while_queued_never_run_and_leave_no_key(
    server: Server, client: Client, name: str, tmp_path: Path
) -> None:
    answers = abandon_half(server, client, name, "/job")
    kept = [str(i) for i in range(REQUESTS - ABANDONED)]
    assert [a.rsplit("\r\n\r\n", 1)[1] for a in answers] == [f"ran {i}\n" for i in kept]
    assert all(a.startswith("HTTP/1.1 200") for a in answers)
    # Every kept request has run and the queue is empty: an abandoned one can run no more.
    assert sema_keys(client, name, 1) == []
    assert sorted((tmp_path / "ran").read_text().split(), key=int) == kept
    server.stop()
    assert sema_keys(client, name) == []


def test_without_the_pattern_abandoned_requests_still_run(
    server: Server, client: Client, name: str, tmp_path: Path
) -> None:
    """The premise of the pattern: uvicorn does not cancel the handler of a client gone."""
    abandon_half(server, client, name, "/job-naive")
    ran = tmp_path / "ran"
    poll(
        lambda: ran.exists() and len(ran.read_text().split()) == REQUESTS,
        what="all 20 jobs run",
    )
    poll(lambda: sema_keys(client, name) == [], what="the queue drained")
    server.stop()
