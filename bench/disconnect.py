"""Abandoned web requests: how many still run their job, without and with the pattern.

    .venv/bin/python bench/disconnect.py [--requests 200] [--abandon 50] [--reps 3]

Starts a throwaway etcd and uvicorn (the ``bench`` extra) serving examples/asgi_disconnect.py
on free loopback ports. For each route, ``/job-naive`` (the handler just awaits the acquire)
and ``/job`` (the acquire raced against ``http.disconnect``, cancelled when the client goes):
this process holds the semaphore's one slot, sends ``--requests`` requests and waits until
all are queued (a key each in etcd), closes the connections of ``--abandon`` of them picked
at random, releases the slot, and waits until the queue has drained. It reports how many
abandoned requests still ran their job (the app logs each job it starts), how long the
abandoned keys took to leave the queue, and what was left in etcd.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import conch  # noqa: E402
from conch import keys, log  # noqa: E402
from conch.etcd import kv  # noqa: E402
from tests.etcd_server import EtcdCluster, free_port  # noqa: E402

ROUTES = ("/job-naive", "/job")


def until(check: Any, timeout: float, what: str) -> float:
    """Poll ``check()`` every 20 ms until true; seconds taken. Raises after ``timeout``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def trial(
    cluster: EtcdCluster, route: str, args: argparse.Namespace, tmp: Path, rep: int
) -> dict[str, Any]:
    name = f"abandon-{route.strip('/')}-{rep}"
    ran = tmp / f"ran-{name}"
    port = free_port()
    env = dict(os.environ)
    env.update(
        CONCH_ENDPOINTS=cluster.endpoints,
        CONCH_EXAMPLE_NAME=name,
        CONCH_EXAMPLE_MAX="1",
        CONCH_EXAMPLE_JOB=str(args.job),
        CONCH_EXAMPLE_RAN=str(ran),
        PYTHONPATH=str(ROOT),
    )
    argv = [sys.executable, "-m", "uvicorn", "examples.asgi_disconnect:app", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--http", "h11", "--lifespan", "on", "--log-level", "error"]
    server = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    prefix = keys.sema_prefix(name, 1)
    with cluster.client() as client:
        try:

            def listening() -> bool:
                if server.poll() is not None:
                    raise RuntimeError(f"uvicorn exited {server.returncode}")
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    return True
                return False

            def queued() -> int:
                return len(kv.range_prefix(client, prefix).kvs)

            until(listening, 30, "uvicorn")
            hold = conch.Semaphore(client, name, max=1, ttl=10).acquire(timeout=10)
            socks = []
            for i in range(args.requests):
                sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                request = f"GET {route}?id={i} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
                sock.sendall(request.encode())
                socks.append(sock)
            until(lambda: queued() == 1 + args.requests, 120, "every request queued")
            abandoned = set(random.Random(rep).sample(range(args.requests), args.abandon))
            for i in abandoned:
                socks[i].close()
            left_queue_s = float("nan")
            with contextlib.suppress(RuntimeError):  # the naive route's keys stay: no figure
                left_queue_s = until(
                    lambda: queued() == 1 + args.requests - args.abandon,
                    args.job * args.requests + 5 if route == "/job" else 2,
                    "the abandoned keys gone",
                )
            hold.release()
            until(lambda: queued() == 0, args.job * args.requests * 3 + 60, "the queue drained")
            for i, sock in enumerate(socks):
                if i not in abandoned:
                    while sock.recv(4096):
                        pass
                sock.close()
            jobs = ran.read_text().split() if ran.exists() else []
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        return {
            "route": route,
            "requests": args.requests,
            "abandoned": args.abandon,
            "abandoned_ran": sum(int(j) in abandoned for j in jobs),
            "kept_ran": sum(int(j) not in abandoned for j in jobs),
            "abandoned_left_queue_s": left_queue_s,
            "keys_left": len(kv.range_prefix(client, keys.name_prefix(name)).kvs),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--abandon", type=int, default=50)
    parser.add_argument("--job", type=float, default=0.02, help="seconds each job takes")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.abandon <= args.requests:
        parser.error("--abandon must be between 1 and --requests")
    log.set_quiet(True)
    with tempfile.TemporaryDirectory(prefix="conch-disconnect-") as scratch:
        tmp = Path(scratch)
        cluster = EtcdCluster(tmp / "etcd")
        cluster.start()
        try:
            for rep in range(args.reps):
                for route in ROUTES if rep % 2 == 0 else ROUTES[::-1]:
                    r = trial(cluster, route, args, tmp, rep)
                    gone = r["abandoned_left_queue_s"]
                    print(
                        f"{route:10} {r['abandoned_ran']} of {r['abandoned']} abandoned ran,"
                        f" {r['kept_ran']} of {r['requests'] - r['abandoned']} kept ran;"
                        + (
                            " abandoned keys still queued 2 s after the disconnects;"
                            if math.isnan(gone)
                            else f" abandoned keys gone {gone:.2f} s after the disconnects;"
                        )
                        + f" {r['keys_left']} keys left at the end",
                        flush=True,
                    )
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
