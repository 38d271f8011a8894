"""Acquire+release cycles of one asyncio process: conch.aio against aetcd and etcd3aio.

    .venv/bin/python bench/cycles.py [--reps 3] [--cycles 200] [--contenders 20]
        [--seconds 10] [--checkout DIR[=LABEL]]...

Starts a throwaway etcd (tests/etcd_server.py) and, in one subprocess per variant (the
peers register etcd's protos under the same names: one per process), measures on one loop:

    uncontended   ``--cycles`` acquire+release of a free slot (max 1), one after another:
                  the milliseconds of each cycle, p50 and p99
    contended     ``--contenders`` tasks cycling acquire+release on one slot (max 1) for
                  ``--seconds``: cycles per second

Variants: ``aio`` (conch.aio, on each ``--checkout``, as bench/waiting.py takes it),
``aio-shared`` (the same, every acquire on one live ``conch.aio.Session``: no LeaseGrant or
LeaseRevoke a cycle, as a service that shares one session pays),
``threads`` (conch.Semaphore: uncontended only, for reference), ``aetcd`` and ``etcd3aio``
(bench/peers.py's queue recipe: grant a lease, put prefix/lease-id on it, range the
prefix by create_revision, watch the key ahead for its delete; release deletes the key and
revokes the lease; no lease refresh, a cycle being far shorter than the TTL). Variants
run interleaved, their order rotated each repetition; the table gives medians [min-max] of
the repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from waiting import checkout_label, median, pct, worker_env  # noqa: E402

VARIANTS = ("aio", "aio-shared", "threads", "aetcd", "etcd3aio")

Cycle = Callable[[str], Awaitable[None]]


async def conch_aio(
    endpoint: str, shared: bool = False
) -> tuple[Cycle, Callable[[], Awaitable[None]]]:
    import conch.aio
    from conch import log

    log.set_quiet(True)
    client = await conch.aio.connect(endpoint, dial_timeout=10.0, request_timeout=10.0)
    session = await conch.aio.Session(client, ttl=10) if shared else None

    async def cycle(name: str) -> None:
        sema = conch.aio.Semaphore(client, name, max=1, ttl=10)
        hold = await sema.acquire(timeout=30, session=session)
        await hold.release()

    async def close() -> None:
        if session is not None:
            await session.close()
        await client.close()

    return cycle, close


async def conch_aio_shared(endpoint: str) -> tuple[Cycle, Callable[[], Awaitable[None]]]:
    return await conch_aio(endpoint, shared=True)


async def aetcd_(endpoint: str) -> tuple[Cycle, Callable[[], Awaitable[None]]]:
    import aetcd  # type: ignore[import-untyped]
    from peers import aetcd_turn

    host, port = endpoint.rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port), timeout=10)
    await client.connect()

    async def cycle(name: str) -> None:
        async with aetcd_turn(client, f"/bench/aetcd/{name}/".encode(), 10, keepalive=False):
            pass

    return cycle, client.close


async def etcd3aio_(endpoint: str) -> tuple[Cycle, Callable[[], Awaitable[None]]]:
    from etcd3aio import Etcd3Client
    from peers import etcd3aio_turn

    client = Etcd3Client([endpoint])
    await client.connect()

    async def cycle(name: str) -> None:
        prefix = f"__etcd3aio:lock/{name}/".encode()
        async with etcd3aio_turn(client, prefix, 10, keepalive=False):
            pass

    return cycle, client.close


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
    makers = {"aio": conch_aio, "aio-shared": conch_aio_shared, "aetcd": aetcd_}
    make = {**makers, "etcd3aio": etcd3aio_}[args.worker]
    cycle, close = await make(args.endpoint)
    try:
        for _ in range(5):  # warm: channels, streams, caches
            await cycle(f"u-{args.tag}")
        times = []
        for _ in range(args.cycles):
            started = time.perf_counter()
            await cycle(f"u-{args.tag}")
            times.append((time.perf_counter() - started) * 1000)
        count = 0
        end = time.monotonic() + args.seconds

        async def contender() -> None:
            nonlocal count
            while time.monotonic() < end:
                await cycle(f"c-{args.tag}")
                count += 1

        started = time.monotonic()
        await asyncio.gather(*(contender() for _ in range(args.contenders)))
        rate = count / (time.monotonic() - started)
    finally:
        await close()
    return {"p50_ms": pct(times, 50), "p99_ms": pct(times, 99), "cycles_per_s": rate}


def run_threads(args: argparse.Namespace) -> dict[str, Any]:
    import conch
    from conch import log

    log.set_quiet(True)
    with conch.connect(args.endpoint, dial_timeout=10.0, request_timeout=10.0) as client:
        sema = conch.Semaphore(client, f"u-{args.tag}", max=1, ttl=10)
        for _ in range(5):
            sema.acquire(timeout=30).release()
        times = []
        for _ in range(args.cycles):
            started = time.perf_counter()
            sema.acquire(timeout=30).release()
            times.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": pct(times, 50), "p99_ms": pct(times, 99)}


def worker(args: argparse.Namespace) -> int:
    result = run_threads(args) if args.worker == "threads" else asyncio.run(run_async(args))
    print(json.dumps(result), flush=True)
    return 0


def orchestrate(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from tests.etcd_server import EtcdCluster

    checkouts = [
        (Path(c.split("=", 1)[0]).resolve(), c.split("=", 1)[1] if "=" in c else "")
        for c in args.checkout
    ] or [(ROOT, "")]
    checkouts = [(path, label or checkout_label(path)) for path, label in checkouts]
    rows: list[tuple[str, str, Path | None]] = []
    for variant in args.variants.split(","):
        if variant in ("aio", "aio-shared", "threads"):
            for path, label in checkouts:
                rows.append(
                    (variant if len(checkouts) == 1 else f"{variant} @{label}", variant, path)
                )
        else:
            rows.append((variant, variant, None))
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row, _, _ in rows}
    tmp = Path(tempfile.mkdtemp(prefix="conch-cycles-"))
    cluster = EtcdCluster(tmp / "etcd")
    try:
        cluster.start()
        endpoint = cluster.members[0].endpoint
        print(f"etcd on {endpoint}", flush=True)
        for rep in range(args.reps):
            shift = rep * len(rows) // args.reps
            for i, (row, variant, path) in enumerate(rows[shift:] + rows[:shift]):
                argv = [sys.executable, str(HERE / "cycles.py"), "--worker", variant]
                argv += ["--endpoint", endpoint, "--tag", f"{rep}-{i}"]
                argv += ["--cycles", str(args.cycles), "--contenders", str(args.contenders)]
                argv += ["--seconds", str(args.seconds)]
                env = worker_env(path, tmp / "pycache")
                out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
                if out.returncode:
                    raise RuntimeError(f"{row}: exited {out.returncode}: {out.stderr[-2000:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                runs[row].append(result)
                print(f"rep {rep + 1}/{args.reps} {row:16} {result}", flush=True)
    finally:
        cluster.stop()
    print()
    for key, label in (
        ("p50_ms", "uncontended p50 ms"),
        ("p99_ms", "p99 ms"),
        ("cycles_per_s", f"{args.contenders} contenders cycles/s"),
    ):
        cells = []
        for row, results in runs.items():
            xs = [r[key] for r in results if key in r]
            if xs:
                cells.append(f"{row} {median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")
        print(f"{label:28} " + "  ".join(cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--contenders", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--checkout", action="append", default=[])
    parser.add_argument("--out", default=str(HERE / "results" / "cycles.json"))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="0", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return worker(args) if args.worker else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
