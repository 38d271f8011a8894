"""conch vs `etcdctl lock`: start-up cost, handoff latency, queue scaling, memory.

    .venv/bin/python bench/run.py [--quick] [--out FILE]

Starts a throwaway etcd (tests/etcd_server.py) on free loopback ports, runs every benchmark
against it, prints a table and writes the results as JSON (default bench/results/latest.json).
Every figure is the median over repeated runs with its spread [min-max]; every comparison is
a ratio conch / etcdctl measured in the same run on the same etcd. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conchpb.etcdserverpb import rpc_pb2  # noqa: E402

from conch import keys, log  # noqa: E402
from conch.etcd import kv  # noqa: E402
from conch.etcd.client import connect  # noqa: E402
from conch.semaphore import Semaphore  # noqa: E402
from tests.etcd_server import EtcdCluster, etcd_binary, etcdctl_binary  # noqa: E402

# Every conch started here runs the code of this checkout (not whatever the venv's editable
# install points to), so that a copy of another commit benchmarks that commit.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), str(ROOT / "generated"), os.environ.get("PYTHONPATH")) if p
)
# An installed conch runs from compiled bytecode; with PYTHONDONTWRITEBYTECODE set (as in some
# shells here) every run would compile conch's sources again, about 40 ms of every start-up.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
PYTHON = sys.executable
CONCH = str(Path(sys.executable).parent / "conch")
ETCDCTL = etcdctl_binary()
TOOLS = ("conch", "etcdctl")

# The child both tools run: bash's builtin $EPOCHREALTIME, appended to a log. No fork, no
# `date`; identical for both, so its own cost cancels in every comparison.
STAMP_START = 'echo "S $EPOCHREALTIME" >> "$1"'
STAMP_END = 'echo "E $EPOCHREALTIME" >> "$1"'
WAITER_CHILD = ["bash", "-c", f"{STAMP_START}; {STAMP_END}", "child"]
# A waiter whose job takes a while (the second handoff measure): $2 seconds of sleep(1).
JOB_CHILD = ["bash", "-c", f'{STAMP_START}; sleep "$2"; {STAMP_END}', "child"]
# The first holder blocks on a FIFO until the benchmark releases it.
HOLDER_CHILD = ["bash", "-c", f'{STAMP_START}; read -r _ < "$2"; {STAMP_END}', "child"]

IMPORT_FLOOR = [PYTHON, "-c", "import grpc, google.protobuf"]
# What any Python etcd client pays (bench/floor.py): start, dial, one call; and a waiter
# reduced to the channel and the two streams a waiting conch keeps open.
FLOOR = [PYTHON, str(ROOT / "bench" / "floor.py")]
BARE_PYTHON = [PYTHON, "-I", "-S", "-c", "import sys; sys.stdin.read()"]

LAUNCHER = r"""
import json, os, shutil, sys, time
argv = sys.argv[1:]
path = shutil.which(argv[0])
null = os.open(os.devnull, os.O_RDWR)
actions = [(os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]
t0 = time.perf_counter()
pid = os.posix_spawn(path, argv, os.environ, file_actions=actions)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - t0
print(json.dumps([seconds, usage.ru_maxrss, os.waitstatus_to_exitcode(status)]))
"""

HUNG = -1000  # exit code we report for a process that had to be killed
HANG_AFTER = 20.0  # seconds a wrapper may take to exit once its child is done
IDLE_WINDOW = 3.0  # seconds over which the CPU use of W queued waiters is measured
IDLE_FROM_W = 100  # ... in the chains with this many waiters or more
FLOOR_WINDOW = 10.0  # seconds over which the floors section reads CPU and wake-ups

SECTIONS = ("uncontended", "floors", "sweep", "chains", "scaling")
PROCS: list[subprocess.Popen[bytes]] = []  # everything we started, killed on the way out


# ---------------------------------------------------------------------------------- helpers


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "median": median(xs),
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
        "n": len(xs),
        "runs": xs,
    }


def spawn(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.DEVNULL)
    proc = subprocess.Popen(argv, start_new_session=True, **kw)
    PROCS.append(proc)
    return proc


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def reap_all() -> None:
    """SIGTERM then SIGKILL whatever we started that is still running (by pid, not name)."""
    live = [p for p in PROCS if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
    PROCS[:] = [p for p in PROCS if p.poll() is None]


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def proc_mem(pid: int) -> dict[str, int]:
    """RSS and PSS of one process, in kB (PSS splits shared pages among their users)."""
    out = {"rss_kb": 0, "pss_kb": 0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                out["rss_kb"] = int(line.split()[1])
            elif line.startswith("Pss:"):
                out["pss_kb"] = int(line.split()[1])
    except OSError:
        pass
    return out


def tree_mem(pid: int) -> dict[str, int]:
    """RSS and PSS of a process plus its direct children, in kB: a waiting conch counts with
    the watchdog it starts before queueing (etcdctl has no children while it waits)."""
    total = {"rss_kb": 0, "pss_kb": 0}
    for p in tree(pid):
        for key, value in proc_mem(p).items():
            total[key] += value
    return total


def tree(pid: int) -> list[int]:
    """A process and its direct children (a conch waiter and its watchdog)."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid, *(int(c) for c in children)]
    return [pid]


def tree_threads(pid: int) -> int:
    """Threads of a process plus its direct children (a conch waiter and its watchdog)."""
    count = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            count += len(os.listdir(f"/proc/{p}/task"))
    return count


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by a process and its direct
    children."""
    ticks = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_tasks(pid: int) -> tuple[float, int]:
    """(CPU seconds, wake-ups) so far of every thread of a process and its direct children,
    from /proc/PID/task/*/schedstat (nanoseconds on the CPU: finer than clock ticks) and
    each thread's voluntary context switches (a thread that only waits switches out once
    per wake-up). A thread that ends within the window takes its share with it."""
    ns = switches = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    ns += int(Path(f"/proc/{p}/task/{task}/schedstat").read_text().split()[0])
                    for line in Path(f"/proc/{p}/task/{task}/status").read_text().splitlines():
                        if line.startswith("voluntary_ctxt_switches:"):
                            switches += int(line.split()[1])
    return ns / 1e9, switches


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat's first line:
    user, nice, system, irq, softirq; not idle, iowait, nor a VM's steal), in clock ticks'
    resolution."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[0:3]) + sum(fields[5:7])
    return busy / os.sysconf("SC_CLK_TCK")


def read_stamps(path: Path, slots: int = 1) -> tuple[list[float], list[float]]:
    """(starts, ends), each in time order, from a child log; checks that no more than
    ``slots`` children ever ran at once."""
    events = sorted(
        (float(value), kind)
        for kind, value in (line.split() for line in path.read_text().splitlines())
    )
    running = 0
    for _, kind in events:
        running += 1 if kind == "S" else -1
        if running > slots:
            raise RuntimeError(f"{path}: {running} children ran at once (max {slots})")
    starts = [t for t, kind in events if kind == "S"]
    ends = [t for t, kind in events if kind == "E"]
    return starts, ends


def handoffs_ms(starts: list[float], ends: list[float], slots: int) -> list[float]:
    """With the queue full, each child after the first ``slots`` starts on the slot that
    the (k - slots)-th end freed (FIFO): handoff k = starts[k] - ends[k - slots], in ms."""
    return [(starts[k] - ends[k - slots]) * 1000 for k in range(slots, len(starts))]


# ---------------------------------------------------------------------------------- metrics

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_METHOD = re.compile(r'grpc_method="([^"]+)"')


def scrape(endpoint: str) -> dict[str, float]:
    """etcd's /metrics on its client URL, reduced to the counters we use."""
    for attempt in range(3):  # a loaded etcd now and then cuts the answer short
        try:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
                text = response.read().decode()
            break
        except http.client.IncompleteRead:
            if attempt == 2:
                raise
            time.sleep(0.5)
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name in (
            "grpc_server_started_total",
            "grpc_server_msg_received_total",
            "grpc_server_msg_sent_total",
        ):
            method = _METHOD.search(labels)
            key = f"{name}:{method.group(1) if method else '?'}"
            out[key] = out.get(key, 0.0) + value
        elif name in (
            "etcd_network_client_grpc_sent_bytes_total",
            "etcd_network_client_grpc_received_bytes_total",
            "etcd_debugging_mvcc_events_total",
            "etcd_debugging_mvcc_watcher_total",
            "etcd_debugging_mvcc_watch_stream_total",
        ):
            out[name] = value
    return out


def delta(before: dict[str, float], after: dict[str, float], per: float) -> dict[str, Any]:
    """What happened between two scrapes, per ``per`` (releases or runs)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}

    def total(prefix: str, keepalive: bool) -> float:
        return sum(
            v
            for k, v in d.items()
            if k.startswith(prefix + ":") and (k.endswith(":LeaseKeepAlive") == keepalive)
        )

    by_method = {
        k.split(":", 1)[1]: v / per
        for k, v in d.items()
        if k.startswith("grpc_server_started_total:") and v
    }
    return {
        # RPCs started: unary calls plus streams opened (watch, keepalive)
        "requests": total("grpc_server_started_total", False) / per,
        "requests_by_method": dict(sorted(by_method.items())),
        # messages on all calls and streams, keepalives apart (they scale with waiters x time)
        "msgs_in": total("grpc_server_msg_received_total", False) / per,
        "msgs_out": total("grpc_server_msg_sent_total", False) / per,
        "keepalive_msgs_in": total("grpc_server_msg_received_total", True) / per,
        "watch_events": d.get("etcd_debugging_mvcc_events_total", 0.0) / per,
        "bytes_read": d.get("etcd_network_client_grpc_sent_bytes_total", 0.0) / per,
        "bytes_written": d.get("etcd_network_client_grpc_received_bytes_total", 0.0) / per,
    }


# ------------------------------------------------------------------------------ benchmarks


class Bench:
    def __init__(self, endpoint: str, tmp: Path, quick: bool) -> None:
        self.endpoint = endpoint
        self.tmp = tmp
        self.quick = quick
        self.client = connect(endpoint, dial_timeout=10.0, request_timeout=10.0)

    # -- etcd probes (made outside every measurement window) ---------------------------------

    def count(self, prefix: bytes) -> int:
        request = rpc_pb2.RangeRequest(key=prefix, range_end=kv.prefix_end(prefix), count_only=True)
        return int(kv.range_(self.client, request).count)

    def wait_queued(
        self,
        prefix: bytes,
        keys: int,
        watchers: int,
        timeout: float,
        procs: list[subprocess.Popen[bytes]],
    ) -> float:
        """Until ``keys`` keys exist under ``prefix`` and etcd has ``watchers`` watchers, and
        then until the watcher count has been steady for 0.5 s. Returns seconds taken."""
        started = time.monotonic()
        deadline = started + timeout
        while self.count(prefix) < keys:
            dead = [p.returncode for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a waiter exited early ({dead[:5]}) while queueing")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.count(prefix)}/{keys} keys after {timeout}s")
            time.sleep(0.1)
        seen, steady_since = -1.0, time.monotonic()
        while True:
            now = scrape(self.endpoint).get("etcd_debugging_mvcc_watcher_total", 0.0)
            if now != seen:
                seen, steady_since = now, time.monotonic()
            if now >= watchers and time.monotonic() - steady_since >= 0.5:
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {now}/{watchers} watchers after {timeout}s")
            time.sleep(0.1)

    def argv(
        self, tool: str, name: str, cmd: list[str], quiet: bool = True, slots: int = 1
    ) -> list[str]:
        if tool == "conch":
            return [
                CONCH,
                "sema",
                name,
                "--max",
                str(slots),
                "--endpoints",
                self.endpoint,
                *(["-q"] if quiet else []),
                "--",
                *cmd,
            ]
        if tool == "floor":  # etcdctl lock's recipe on grpcio, nothing of conch
            return [*FLOOR, "lock", self.endpoint, name, "--", *cmd]
        return [ETCDCTL, "--endpoints", self.endpoint, "lock", name, "--", *cmd]

    def launch(self, argv: list[str]) -> tuple[float, float, int]:
        """Run ``argv`` from a small launcher (python -I -S, ~9 MiB) that times it and reads
        its peak RSS with wait4(): ru_maxrss counts the largest process of the tree *and*
        the launcher's own memory before exec, so launching from this (grpc-laden) process
        would report our RSS instead. Returns (seconds, peak RSS MiB, exit code)."""
        launcher = spawn([PYTHON, "-I", "-S", "-c", LAUNCHER, *argv], stdout=subprocess.PIPE)
        try:
            stdout, _ = launcher.communicate(timeout=HANG_AFTER)
        except subprocess.TimeoutExpired:
            kill_group(launcher)  # the command hangs (at exit, so far): note it, go on
            return float("nan"), float("nan"), HUNG
        seconds, maxrss_kb, code = json.loads(stdout)
        return seconds, maxrss_kb / 1024.0, code

    # -- 1. uncontended --------------------------------------------------------------------

    def uncontended(self, reps: int) -> dict[str, Any]:
        """`conch sema b --max 1 -- true` vs `etcdctl lock b true`, alternating, nobody else
        on the lock: wall time, peak RSS (wait4's ru_maxrss: the largest process of the
        tree, here the wrapper itself), etcd requests per run. Then the same with a child
        that stamps its start, for launch -> child start, and conch's phases from its log."""
        out: dict[str, Any] = {}
        wall: dict[str, list[float]] = {t: [] for t in (*TOOLS, "floor", "client")}
        rss: dict[str, list[float]] = {t: [] for t in TOOLS}
        metrics: dict[str, list[dict[str, Any]]] = {t: [] for t in TOOLS}
        for tool in TOOLS:  # warm the page cache once, unmeasured
            subprocess.run(
                self.argv(tool, "warm", ["true"]),
                timeout=30,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=True,
            )
        hung = dict.fromkeys(TOOLS, 0)
        floor = self.launch(["/bin/true"])[1]
        for i in range(reps):
            for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
                before = scrape(self.endpoint)
                seconds, maxrss_mib, code = self.launch(self.argv(tool, "b", ["true"]))
                if code == HUNG:
                    hung[tool] += 1
                    continue
                if code != 0:
                    raise RuntimeError(f"{tool} uncontended run exited {code}")
                wall[tool].append(seconds)
                rss[tool].append(maxrss_mib)
                metrics[tool].append(delta(before, scrape(self.endpoint), 1))
            # the floor any Python gRPC client starts from, timed the same way
            wall["floor"].append(self.launch(IMPORT_FLOOR)[0])
            # ... and a gRPC etcd client's whole start: the stubs, a channel, one call
            wall["client"].append(self.launch([*FLOOR, "once", self.endpoint])[0])
        out["launcher_floor_rss_mib"] = floor
        out["wall_s"] = {t: summary(wall[t]) for t in wall}
        out["peak_rss_mib"] = {t: summary(rss[t]) for t in TOOLS}
        out["etcd_per_run"] = {t: metrics[t][0] for t in TOOLS}
        out["wall_ratio_runs"] = [
            c / e for c, e in zip(wall["conch"], wall["etcdctl"], strict=False)
        ]

        # launch -> child start, and conch's own phases (timestamped as its log lines arrive)
        to_child: dict[str, list[float]] = {t: [] for t in TOOLS}
        phases: dict[str, list[float]] = {}
        for i in range(reps):
            for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
                log = self.tmp / f"unc-{tool}-{i}.log"
                stamps: list[tuple[str, float]] = []
                t0 = time.time()
                proc = spawn(
                    self.argv(tool, "b", [*WAITER_CHILD, str(log)], False),
                    stderr=subprocess.PIPE,
                )

                def read(proc: subprocess.Popen[bytes], stamps: list[tuple[str, float]]) -> None:
                    assert proc.stderr is not None
                    for raw in proc.stderr:
                        match = re.search(rb"event=(\S+)", raw)
                        if match:
                            stamps.append((match.group(1).decode(), time.time()))

                reader = threading.Thread(target=read, args=(proc, stamps), daemon=True)
                reader.start()
                try:
                    proc.wait(timeout=HANG_AFTER)
                    t_exit = time.time()
                except subprocess.TimeoutExpired:
                    kill_group(proc)
                    hung[tool] += 1
                    t_exit = float("nan")
                reader.join(timeout=5)
                starts, ends = read_stamps(log)
                to_child[tool].append(starts[0] - t0)
                if tool == "conch":
                    marks = dict(stamps)
                    marks["child-running"] = starts[0]
                    marks["child-done"] = ends[0]
                    marks["exit"] = t_exit
                    for event, when in marks.items():
                        if math.isnan(when):
                            continue
                        phases.setdefault(event, []).append((when - t0) * 1000)
        out["launch_to_child_s"] = {t: summary(to_child[t]) for t in TOOLS}
        out["hung_at_exit"] = hung
        out["runs_per_tool"] = 2 * reps
        out["conch_phases_ms"] = {
            k: median(v) for k, v in sorted(phases.items(), key=lambda kv_: median(kv_[1]))
        }
        return out

    # -- 2. import profile -------------------------------------------------------------------

    def importtime(self, reps: int) -> dict[str, Any]:
        """`python -X importtime -c 'import conch.cli'`: median self and cumulative us per
        module over ``reps`` runs, plus whole-process wall times for context."""
        self_us: dict[str, list[int]] = {}
        cum_us: dict[str, list[int]] = {}
        parents: dict[str, str] = {}
        for _ in range(reps):
            result = subprocess.run(
                [PYTHON, "-X", "importtime", "-c", "import conch.cli"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            stack: list[tuple[int, str]] = []
            rows = []
            for line in result.stderr.splitlines():
                match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
                if match:
                    rows.append(
                        (
                            int(match.group(1)),
                            int(match.group(2)),
                            len(match.group(3)) // 2,
                            match.group(4),
                        )
                    )
            # importtime prints children before their parent, the parent one level less deep
            for s, c, depth, name in reversed(rows):
                while stack and stack[-1][0] >= depth:
                    stack.pop()
                if stack:
                    parents.setdefault(name, stack[-1][1])
                stack.append((depth, name))
                self_us.setdefault(name, []).append(s)
                cum_us.setdefault(name, []).append(c)
        cum = {k: median(v) / 1000 for k, v in cum_us.items()}
        slf = {k: median(v) / 1000 for k, v in self_us.items()}

        def wall(code: list[str], n: int) -> float:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                subprocess.run(code, timeout=60, check=True, stdout=subprocess.DEVNULL)
                times.append(time.perf_counter() - t0)
            return median(times) * 1000

        n = max(3, reps)
        parser_ms = json.loads(
            subprocess.run(
                [
                    PYTHON,
                    "-c",
                    "import json,time,conch.cli as c; t=time.perf_counter(); "
                    "c.build_parser().parse_args(['sema','b','--max','1']); "
                    "print(json.dumps((time.perf_counter()-t)*1000))",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        )
        top_level = [
            "conch.cli",
            "conch.etcd",
            "conch.etcd.client",
            "grpc",
            "grpc.aio",
            "grpc._cython.cygrpc",
            "asyncio",
            "conchpb.etcdserverpb.rpc_pb2",
            "conchpb.etcdserverpb.rpc_pb2_grpc",
            "conchpb._pool",
            "google.protobuf.descriptor_pool",
            "google.protobuf.text_format",
            "conch.semaphore",
            "conch.hold",
            "conch.supervisor",
            "conch.watchdog",
            "conch.session",
            "dataclasses",
            "json",
            "datetime",
            "subprocess",
            "argparse",
            "ssl",
            "logging",
            "typing",
            "inspect",
            "pathlib",
            "urllib.parse",
            "typing_extensions",
            "site",
            "__editable___conch_0_1_0_finder",
        ]
        return {
            "total_ms": cum.get("conch.cli"),
            "cumulative_ms": {k: cum[k] for k in top_level if k in cum},
            "top_self_ms": dict(sorted(slf.items(), key=lambda kv_: -kv_[1])[:20]),
            "parent_of": {k: parents.get(k) for k in top_level if k in parents},
            "build_parser_ms": parser_ms,
            "wall_ms": {
                "python -c pass": wall([PYTHON, "-c", "pass"], n),
                "python -I -S -c pass (watchdog)": wall([PYTHON, "-I", "-S", "-c", "pass"], n),
                "python -c 'import grpc'": wall([PYTHON, "-c", "import grpc"], n),
                "python -c 'import conch.cli'": wall([PYTHON, "-c", "import conch.cli"], n),
                "conch --version": wall([CONCH, "--version"], n),
                "etcdctl version": wall([ETCDCTL, "version"], n),
            },
        }

    # -- 2b. the floors: a Python gRPC waiter beside conch and etcdctl ----------------------

    def floors(self, n: int) -> dict[str, Any]:
        """``n`` waiting processes of each kind side by side, conch's and etcdctl's queued
        behind a key of no lease: conch (with its watchdog), `etcdctl lock`, the floor
        waiter (bench/floor.py wait: grpcio's channel and the two streams a waiting conch
        keeps open, nothing of conch) and a bare interpreter (`python -I -S` reading its
        stdin: what conch's watchdog is before its own code). Over FLOOR_WINDOW seconds,
        all in the same window so that the machine's load falls on every kind alike: CPU
        and wake-ups of each process (all threads, its children included); then PSS, RSS
        and threads. Medians per process."""
        sema_prefix = keys.sema_prefix("floor", 1)
        kv.put(self.client, sema_prefix + b"0", b"{}")
        kv.put(self.client, b"floor/0", b"")
        kinds: dict[str, list[subprocess.Popen[bytes]]] = {
            "conch": [spawn(self.argv("conch", "floor", ["true"])) for _ in range(n)],
            "etcdctl": [spawn(self.argv("etcdctl", "floor", ["true"])) for _ in range(n)],
            "floor": [spawn([*FLOOR, "wait", self.endpoint, "floor-key"]) for _ in range(n)],
            "bare": [spawn(BARE_PYTHON, stdin=subprocess.PIPE) for _ in range(n)],
        }
        everyone = [p for procs in kinds.values() for p in procs]
        self.wait_queued(sema_prefix, n + 1, 0, 60, kinds["conch"])
        self.wait_queued(b"floor/", n + 1, 3 * n, 60, everyone)
        time.sleep(1.0)  # past every start-up's last allocations and the first keepalive
        before = {k: [tree_tasks(p.pid) for p in procs] for k, procs in kinds.items()}
        t0 = time.monotonic()
        time.sleep(FLOOR_WINDOW)
        seconds = time.monotonic() - t0
        after = {k: [tree_tasks(p.pid) for p in procs] for k, procs in kinds.items()}
        out: dict[str, Any] = {"processes": n, "window_s": seconds}
        for kind, procs in kinds.items():
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a {kind} process exited while it should wait")
            mem = [tree_mem(p.pid) for p in procs]
            used = list(zip(after[kind], before[kind], strict=True))
            out[kind] = {
                "cpu_ms_per_s": median([(a[0] - b[0]) * 1000 / seconds for a, b in used]),
                "wakeups_per_s": median([(a[1] - b[1]) / seconds for a, b in used]),
                "pss_mib": median([m["pss_kb"] / 1024 for m in mem]),
                "rss_mib": median([m["rss_kb"] / 1024 for m in mem]),
                "threads": median([tree_threads(p.pid) for p in procs]),
            }
        for p in everyone:
            kill_group(p)
            if p.stdin is not None:
                p.stdin.close()
        kv.delete(self.client, sema_prefix + b"0")
        kv.delete(self.client, b"floor/0")
        return out

    # -- 3./5. handoff chain (and the memory of waiting processes) ---------------------------

    def chain(
        self,
        tool: str,
        waiters: int,
        rep: int,
        job: float = 0.0,
        slots: int = 1,
        tag: str = "chain",
    ) -> dict[str, Any]:
        """``slots`` holders and then ``waiters`` queued processes of ``tool`` on a lock (a
        semaphore of ``slots`` for conch); release the holders at once, let the queue drain.
        Handoff = a child's first stamp - the last stamp of the child whose slot it took.
        Each waiter's child exits at once, or after ``job`` seconds.

        `etcdctl lock` has no slots: for ``slots`` > 1 it runs that many locks side by side,
        the waiters dealt among them, so that as many jobs and wrappers turn over at once
        as with conch's ``--max`` (what the machine's churn costs a handoff, with no
        semaphore in it)."""
        name = f"{tag}-{tool}-{slots}-{waiters}-{rep}-{job * 1000:.0f}"
        locks = slots if tool == "etcdctl" else 1
        # (lock name, child log, holders) of each queue
        queues = [(name, self.tmp / f"{name}.log", slots)]
        if locks > 1:
            queues = [(f"{name}-{i}", self.tmp / f"{name}-{i}.log", 1) for i in range(locks)]
        prefix = f"/conch/v1/sema/{name}/{slots}/" if tool == "conch" else f"{name}/"
        if locks > 1:
            prefix = f"{name}-"  # every lock's keys
        fifos: list[Path] = []
        holders = []
        for lock, child_log, n in queues:
            for _ in range(n):
                fifo = self.tmp / f"{name}-{len(fifos)}.fifo"
                os.mkfifo(fifo)
                fifos.append(fifo)
                cmd = [*HOLDER_CHILD, str(child_log), str(fifo)]
                holders.append(spawn(self.argv(tool, lock, cmd, slots=n)))

        def lines() -> int:
            return sum(q[1].read_text().count("\n") for q in queues if q[1].exists())

        deadline = time.monotonic() + 30
        while lines() < slots:
            if any(h.poll() is not None for h in holders) or time.monotonic() > deadline:
                raise RuntimeError(f"{tool} holders did not start their children")
            time.sleep(0.02)
        t0 = time.monotonic()
        procs = []
        for i in range(waiters):
            lock, child_log, n = queues[i % locks]
            child = [*(JOB_CHILD if job else WAITER_CHILD), str(child_log)]
            child += [f"{job:.3f}"] if job else []
            procs.append(spawn(self.argv(tool, lock, child, slots=n)))
        # etcdctl waiters watch their predecessor; each conch waiter one key or the prefix.
        timeout = 60 + 2 * waiters
        queued_s = self.wait_queued(prefix.encode(), waiters + slots, waiters, timeout, procs)
        startup_all = time.monotonic() - t0
        mem = [tree_mem(p.pid) for p in procs]
        threads = [tree_threads(p.pid) for p in procs]
        idle_cpu = None
        if waiters >= IDLE_FROM_W:  # what the queue costs the machine while it only waits
            t1, cpu = time.monotonic(), sum(tree_cpu(p.pid) for p in procs)
            time.sleep(IDLE_WINDOW)
            used = sum(tree_cpu(p.pid) for p in procs) - cpu
            idle_cpu = 100 * used / (time.monotonic() - t1)
        before = scrape(self.endpoint)
        cpu_before = machine_cpu()
        # Each holder's child reads its own FIFO, stamps, exits. With several slots the
        # holders go job/slots apart, so that the slots' handoffs fall apart as in a queue
        # that has run a while, instead of all at once on two cores.
        for i, fifo in enumerate(fifos):
            if i:
                time.sleep(job / slots)
            with open(fifo, "w") as f:
                f.write("go\n")
        deadline = time.monotonic() + 60 + waiters * (1 + job)
        while lines() < 2 * (waiters + slots):
            if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        everyone = [*holders, *procs]
        codes = wait_all(everyone, HANG_AFTER)
        hung = [p for p, c in zip(everyone, codes, strict=True) if c is None]
        for p in hung:  # its child ran and exited, the wrapper did not: a hang at exit
            kill_group(p)
        t_all_exited = time.time()
        cpu_used = machine_cpu() - cpu_before
        after = scrape(self.endpoint)
        if any(c not in (0, None) for c in codes):
            raise RuntimeError(f"{tool} chain W={waiters}: exit codes {codes}")
        handoffs: list[float] = []
        starts: list[float] = []
        ends: list[float] = []
        for _, child_log, n in queues:
            s, e = read_stamps(child_log, n)
            handoffs += handoffs_ms(s, e, n)
            starts += s
            ends += e
        if len(starts) != waiters + slots or len(ends) != waiters + slots:
            raise RuntimeError(f"{tool} chain W={waiters}: {len(starts)} children ran")
        return {
            "handoffs_ms": handoffs,
            "handoff_p50_ms": pct(handoffs, 50),
            "handoff_p99_ms": pct(handoffs, 99),
            "drain_s": max(ends) - min(ends),
            "drain_to_exit_s": t_all_exited - min(ends),
            "hung_at_exit": len(hung),
            "queue_fill_s": startup_all,
            "queued_wait_s": queued_s,
            "waiter_rss_mib": [m["rss_kb"] / 1024 for m in mem],
            "waiter_pss_mib": [m["pss_kb"] / 1024 for m in mem],
            "waiter_threads": threads,
            "waiters_idle_cpu_pct": idle_cpu,
            "etcd_per_release": delta(before, after, waiters + slots),
            # the machine's CPU (etcd, wrappers, children, exits) from the first release to
            # the last exit, per release; meaningful with the queue long enough to drain a
            # while (W = 100)
            "machine_cpu_ms_per_release": cpu_used * 1000 / (waiters + slots),
        }

    def handoff(self, sizes: list[int], reps: int, job: float = 0.0) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for w in sizes:
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TOOLS}
            # A chain of one waiter measures a single handoff: more runs for a stable median.
            n = reps * 5 if w == 1 else reps
            for rep in range(n):
                for tool in TOOLS if rep % 2 == 0 else TOOLS[::-1]:
                    t0 = time.monotonic()
                    runs[tool].append(self.chain(tool, w, rep, job))
                    print(
                        f"  handoff W={w}{f' {job * 1000:.0f} ms jobs' if job else ''} "
                        f"{tool} rep {rep + 1}/{n}: "
                        f"p50 {runs[tool][-1]['handoff_p50_ms']:.1f} ms "
                        f"({time.monotonic() - t0:.1f} s)",
                        flush=True,
                    )
            entry: dict[str, Any] = {}
            for tool in TOOLS:
                rs = runs[tool]
                per = [r["etcd_per_release"] for r in rs]
                entry[tool] = {
                    "handoff_p50_ms": summary([r["handoff_p50_ms"] for r in rs]),
                    "handoff_p99_ms": summary([r["handoff_p99_ms"] for r in rs]),
                    "drain_s": summary([r["drain_s"] for r in rs]),
                    "queue_fill_s": summary([r["queue_fill_s"] for r in rs]),
                    "hung_at_exit": sum(r["hung_at_exit"] for r in rs),
                    "processes": sum(w + 1 for _ in rs),
                    "waiter_rss_mib_one": summary([median(r["waiter_rss_mib"]) for r in rs]),
                    "waiter_pss_mib_one": summary([median(r["waiter_pss_mib"]) for r in rs]),
                    "waiter_threads": summary([median(r["waiter_threads"]) for r in rs]),
                    "waiter_rss_mib_all": summary([sum(r["waiter_rss_mib"]) for r in rs]),
                    "waiter_pss_mib_all": summary([sum(r["waiter_pss_mib"]) for r in rs]),
                    "waiters_idle_cpu_pct": None
                    if w < IDLE_FROM_W
                    else summary([r["waiters_idle_cpu_pct"] for r in rs]),
                    "etcd_per_release": {
                        k: median([p[k] for p in per]) for k in per[0] if k != "requests_by_method"
                    },
                    "requests_by_method": per[len(per) // 2]["requests_by_method"],
                    "machine_cpu_ms_per_release": summary(
                        [r["machine_cpu_ms_per_release"] for r in rs]
                    ),
                }
            out[str(w)] = entry
        return out

    # -- 3b. the job-length sweep ------------------------------------------------------------

    def sweep(self, jobs_ms: list[int], waiters: int, reps: int) -> dict[str, Any]:
        """For each job length: ``waiters`` queued jobs of `etcdctl lock` and of conch at
        --max 1, 2 and 4, and of etcdctl on 2 and 4 locks side by side (the same churn as
        --max 2 and 4) and of the floor (bench/floor.py lock: etcdctl's recipe on grpcio),
        the queue full before the first release; the variants interleave
        (order rotated each repetition) so that machine noise hits them alike. Handoffs are
        pooled over the repetitions for p50/p99; the spread is of the per-run medians."""
        variants = [("etcdctl", 1), ("conch", 1), ("conch", 2), ("conch", 4)]
        variants += [("etcdctl", 2), ("etcdctl", 4)]  # 2 and 4 locks side by side
        variants += [("floor", 1)]  # etcdctl's recipe on grpcio (bench/floor.py lock)
        out: dict[str, Any] = {}
        for ms in jobs_ms:
            pooled: dict[str, list[float]] = {f"{t}/{n}": [] for t, n in variants}
            per_run: dict[str, list[float]] = {k: [] for k in pooled}
            for rep in range(reps):
                turn = variants[rep % len(variants) :] + variants[: rep % len(variants)]
                for tool, slots in turn:
                    r = self.chain(tool, waiters, rep, ms / 1000, slots, tag="sweep")
                    pooled[f"{tool}/{slots}"] += r["handoffs_ms"]
                    per_run[f"{tool}/{slots}"].append(r["handoff_p50_ms"])
                print(
                    f"  sweep {ms} ms jobs rep {rep + 1}/{reps}: "
                    + ", ".join(f"{k} p50 {v[-1]:.1f} ms" for k, v in per_run.items()),
                    flush=True,
                )
            out[str(ms)] = {
                k: {
                    "p50_ms": pct(pooled[k], 50),
                    "p99_ms": pct(pooled[k], 99),
                    "run_p50_ms": summary(per_run[k]),
                    "handoffs": len(pooled[k]),
                }
                for k in pooled
            }
        return out

    # -- 4. queue scaling with library waiters ------------------------------------------------

    def scaling_run(
        self, waiters: int, rep: int, workers: int, hold: float = 0.0
    ) -> dict[str, Any]:
        name = f"scale-{waiters}-{rep}"
        prefix = f"/conch/v1/sema/{name}/1/".encode()
        holder = Semaphore(self.client, name, 1, 10).acquire(timeout=10)
        timeout = 60 + waiters * (0.3 + hold)
        shares = [waiters // workers + (1 if i < waiters % workers else 0) for i in range(workers)]
        outs = [self.tmp / f"{name}-{i}.json" for i in range(workers)]
        procs = [
            spawn(
                [
                    PYTHON,
                    str(ROOT / "bench" / "waiters.py"),
                    self.endpoint,
                    name,
                    str(n),
                    "10",
                    str(out),
                    str(timeout),
                    str(hold),
                ],
                stderr=subprocess.DEVNULL,
            )
            for i, (n, out) in enumerate(zip(shares, outs, strict=False))
            if n
        ]
        t0 = time.monotonic()
        try:
            self.wait_queued(prefix, waiters + 1, waiters + 1, timeout, procs)
        except BaseException:
            holder.release()
            raise
        fill = time.monotonic() - t0
        rss = sum(proc_mem(p.pid)["rss_kb"] for p in procs) / 1024
        before = scrape(self.endpoint)
        released = time.time()
        holder.release()
        codes = wait_all(procs, timeout)
        after = scrape(self.endpoint)
        acquired: list[float] = []
        for out in outs:
            if out.exists():
                data = json.loads(out.read_text())
                acquired += data["acquired"]
                if data["errors"]:
                    raise RuntimeError(f"scaling W={waiters}: {data['errors'][:3]}")
        if any(c != 0 for c in codes) or len(acquired) != waiters:
            raise RuntimeError(f"scaling W={waiters}: codes {codes}, {len(acquired)} acquired")
        acquired.sort()
        gaps = [
            (b - a - (hold if i else 0)) * 1000
            for i, (a, b) in enumerate(zip([released, *acquired], acquired, strict=False))
        ]
        return {
            "drain_s": acquired[-1] - released,
            "handoff_p50_ms": pct(gaps, 50),
            "handoff_p99_ms": pct(gaps, 99),
            "queue_fill_s": fill,
            "rss_mib_per_waiter": rss / waiters,
            "etcd_per_release": delta(before, after, waiters + 1),
        }

    def scaling(self, sizes: list[int], reps: int, workers: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for w in sizes:
            rs = []
            for rep in range(reps):
                t0 = time.monotonic()
                rs.append(self.scaling_run(w, rep, workers))
                print(
                    f"  scaling W={w} rep {rep + 1}/{reps}: drain {rs[-1]['drain_s']:.2f} s, "
                    f"{rs[-1]['etcd_per_release']['requests']:.2f} req/release "
                    f"({time.monotonic() - t0:.1f} s)",
                    flush=True,
                )
            per = [r["etcd_per_release"] for r in rs]
            out[str(w)] = {
                "drain_s": summary([r["drain_s"] for r in rs]),
                "handoff_p50_ms": summary([r["handoff_p50_ms"] for r in rs]),
                "handoff_p99_ms": summary([r["handoff_p99_ms"] for r in rs]),
                "queue_fill_s": summary([r["queue_fill_s"] for r in rs]),
                "rss_mib_per_waiter": summary([r["rss_mib_per_waiter"] for r in rs]),
                "etcd_per_release": {
                    k: summary([p[k] for p in per]) for k in per[0] if k != "requests_by_method"
                },
                "requests_by_method": per[len(per) // 2]["requests_by_method"],
            }
        return out


# ----------------------------------------------------------------------------------- table


def fmt(s: dict[str, Any], digits: int = 1, scale: float = 1.0) -> str:
    if s["n"] <= 1:
        return f"{s['median'] * scale:.{digits}f}"
    return (
        f"{s['median'] * scale:.{digits}f} "
        f"[{s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f}]"
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    return "\n".join(lines)


def sweep_table(sweep: dict[str, Any]) -> str:
    """Handoff by job length: conch --max 1 / etcdctl lock; --max 2, 4 / conch --max 1; and
    --max 2, 4 / etcdctl on as many locks side by side (as many jobs turning over at once)."""
    rows = []
    for ms, e in sweep.items():
        c1, et, c2, c4 = e["conch/1"], e["etcdctl/1"], e["conch/2"], e["conch/4"]
        e2, e4 = e.get("etcdctl/2"), e.get("etcdctl/4")
        rows.append(
            (
                ms,
                f"{et['p50_ms']:.1f}/{et['p99_ms']:.1f}",
                f"{c1['p50_ms']:.1f}/{c1['p99_ms']:.1f}",
                f"{ratio(c1['p50_ms'], et['p50_ms'])}/{ratio(c1['p99_ms'], et['p99_ms'])}",
                f"{c2['p50_ms']:.1f}/{c2['p99_ms']:.1f}",
                ratio(c2["p50_ms"], c1["p50_ms"]),
                ratio(c2["p50_ms"], e2["p50_ms"]) if e2 else "",
                f"{c4['p50_ms']:.1f}/{c4['p99_ms']:.1f}",
                ratio(c4["p50_ms"], c1["p50_ms"]),
                ratio(c4["p50_ms"], e4["p50_ms"]) if e4 else "",
                f"{e4['p50_ms']:.1f}/{ratio(e4['p50_ms'], et['p50_ms'])}" if e4 else "",
                str(c1["handoffs"]),
            )
        )
    header = (
        "job ms",
        "etcdctl p50/p99",
        "conch max1",
        "max1/etcdctl",
        "conch max2",
        "max2/max1",
        "max2/etcdctl x2",
        "conch max4",
        "max4/max1",
        "max4/etcdctl x4",
        "etcdctl x4 p50/vs x1",
        "handoffs",
    )
    return render(header, rows)


def floor_handoff_table(sweep: dict[str, Any]) -> str:
    """At one slot: etcdctl, the same recipe on grpcio (the floor), conch."""
    rows = []
    for ms, e in sweep.items():
        et, fl, c1 = e["etcdctl/1"], e.get("floor/1"), e["conch/1"]
        if fl is None:
            return ""
        rows.append(
            (
                ms,
                f"{et['p50_ms']:.1f}/{et['p99_ms']:.1f}",
                f"{fl['p50_ms']:.1f}/{fl['p99_ms']:.1f}",
                f"{c1['p50_ms']:.1f}/{c1['p99_ms']:.1f}",
                f"{ratio(fl['p50_ms'], et['p50_ms'])}/{ratio(fl['p99_ms'], et['p99_ms'])}",
                f"{ratio(c1['p50_ms'], fl['p50_ms'])}/{ratio(c1['p99_ms'], fl['p99_ms'])}",
            )
        )
    header = ("job ms", "etcdctl p50/p99", "floor", "conch max1", "floor/etcdctl", "conch/floor")
    return render(header, rows)


def floors_table(f: dict[str, Any]) -> str:
    """conch, etcdctl, the floor waiter and the floor with a bare interpreter beside it (as
    conch's watchdog is), each against etcdctl; conch against its floor."""
    et, conch, floor, bare = f["etcdctl"], f["conch"], f["floor"], f["bare"]
    floor_bare = {k: floor[k] + bare[k] for k in floor}
    rows = []
    for label, v in (
        ("etcdctl lock", et),
        ("conch (+ watchdog)", conch),
        ("floor: grpcio waiter (bench/floor.py)", floor),
        ("floor + bare interpreter (python -I -S)", floor_bare),
    ):
        rows.append(
            (
                label,
                f"{v['pss_mib']:.1f}",
                f"{v['threads']:.0f}",
                f"{v['cpu_ms_per_s']:.2f}",
                f"{v['wakeups_per_s']:.1f}",
                ratio(v["pss_mib"], et["pss_mib"]),
                ratio(v["cpu_ms_per_s"], et["cpu_ms_per_s"]),
            )
        )
    rows.append(
        (
            "conch / (floor + bare interpreter)",
            ratio(conch["pss_mib"], floor_bare["pss_mib"]),
            ratio(conch["threads"], floor_bare["threads"]),
            ratio(conch["cpu_ms_per_s"], floor_bare["cpu_ms_per_s"]),
            ratio(conch["wakeups_per_s"], floor_bare["wakeups_per_s"]),
            "",
            "",
        )
    )
    header: tuple[str, ...] = ("process", "PSS MiB", "threads", "CPU ms/s", "wake-ups/s")
    header += ("PSS/etcdctl", "CPU/etcdctl")
    return render(header, rows)


def table(results: dict[str, Any]) -> str:
    """The tables of the sections that ran: the comparison (median [min-max] over runs;
    ratio of medians), the job-length sweep, and etcd's work per release."""
    rows: list[tuple[str, ...]] = []

    def compare(
        label: str, c: dict[str, Any], e: dict[str, Any], digits: int = 1, scale: float = 1.0
    ) -> None:
        rows.append(
            (label, fmt(c, digits, scale), fmt(e, digits, scale), ratio(c["median"], e["median"]))
        )

    hung = dict.fromkeys(TOOLS, 0)
    runs = dict.fromkeys(TOOLS, 0)
    u = results.get("uncontended")
    if u:
        wall = u["wall_s"]
        compare("uncontended: wall time, ms", wall["conch"], wall["etcdctl"], 0, 1000)
        floor = wall["floor"]["median"]
        rows.append(
            (
                "uncontended: over the import floor, ms",
                f"{(wall['conch']['median'] - floor) * 1000:.0f}",
                f"floor {floor * 1000:.0f}",
                "",
            )
        )
        client = wall["client"]["median"]
        rows.append(
            (
                "uncontended: over a gRPC client's start, ms",
                f"{(wall['conch']['median'] - client) * 1000:.0f}",
                f"bench/floor.py once {client * 1000:.0f}",
                "",
            )
        )
        compare(
            "uncontended: launch -> child running, ms",
            u["launch_to_child_s"]["conch"],
            u["launch_to_child_s"]["etcdctl"],
            0,
            1000,
        )
        compare(
            "uncontended: peak RSS, MiB", u["peak_rss_mib"]["conch"], u["peak_rss_mib"]["etcdctl"]
        )
        ec, ee = u["etcd_per_run"]["conch"], u["etcd_per_run"]["etcdctl"]
        rows.append(
            (
                "uncontended: etcd requests per run",
                f"{ec['requests']:.0f}",
                f"{ee['requests']:.0f}",
                ratio(ec["requests"], ee["requests"]),
            )
        )
        for t in TOOLS:
            hung[t] += u["hung_at_exit"][t]
            runs[t] += u["runs_per_tool"]
        imp = results["importtime"]
        rows.append(
            ("start-up: import conch.cli (-X importtime), ms", f"{imp['total_ms']:.0f}", "", "")
        )
    chains = results.get("handoff", {})
    for w, entry in chains.items():
        c, e = entry["conch"], entry["etcdctl"]
        compare(f"instant jobs W={w}: p50, ms", c["handoff_p50_ms"], e["handoff_p50_ms"])
        compare(f"instant jobs W={w}: p99, ms", c["handoff_p99_ms"], e["handoff_p99_ms"])
        compare(f"instant jobs W={w}: drain, s", c["drain_s"], e["drain_s"], 2)
        for t in TOOLS:
            hung[t] += entry[t]["hung_at_exit"]
            runs[t] += entry[t]["processes"]
    if chains:
        sizes = sorted(chains, key=int)
        one, many = chains[sizes[0]], chains[sizes[-1]]
        for what in ("rss", "pss"):
            compare(
                f"memory: {what.upper()} of one waiter (+ watchdog), MiB",
                one["conch"][f"waiter_{what}_mib_one"],
                one["etcdctl"][f"waiter_{what}_mib_one"],
            )
        compare(
            f"memory: PSS of {sizes[-1]} waiters (+ watchdogs), MiB",
            many["conch"]["waiter_pss_mib_all"],
            many["etcdctl"]["waiter_pss_mib_all"],
            0,
        )
        compare(
            "threads of one waiter (+ watchdog)",
            one["conch"]["waiter_threads"],
            one["etcdctl"]["waiter_threads"],
            0,
        )
        compare(
            f"machine CPU per release, W={sizes[-1]} instant jobs, ms",
            many["conch"]["machine_cpu_ms_per_release"],
            many["etcdctl"]["machine_cpu_ms_per_release"],
        )
        if many["conch"]["waiters_idle_cpu_pct"] is not None:
            compare(
                f"CPU of {sizes[-1]} waiters while queued, % of a core",
                many["conch"]["waiters_idle_cpu_pct"],
                many["etcdctl"]["waiters_idle_cpu_pct"],
                2,
            )
    if rows:
        rows.append(
            (
                "wrappers hung at exit (killed) / runs",
                f"{hung['conch']}/{runs['conch']}",
                f"{hung['etcdctl']}/{runs['etcdctl']}",
                "",
            )
        )
    parts = [render(("metric", "conch", "etcdctl lock", "conch/etcdctl"), rows)] if rows else []
    if "floors" in results:
        parts.append(
            "Waiting processes side by side, and the floor any Python gRPC waiter pays "
            "(medians per process):\n" + floors_table(results["floors"])
        )
    if "sweep" in results:
        parts.append(
            "Handoff by job length, queue full (ms, p50/p99 of all handoffs of all runs):\n"
            + sweep_table(results["sweep"])
        )
        floor = floor_handoff_table(results["sweep"])
        if floor:
            parts.append(
                "At one slot against the floor, etcdctl's recipe on grpcio (bench/floor.py "
                "lock; ms):\n" + floor
            )

    srows: list[tuple[str, ...]] = []

    def row(label: str, w: str, p: dict[str, float], drain: str, p50: float, p99: float) -> None:
        srows.append(
            (
                label,
                w,
                f"{p['requests']:.2f}",
                f"{p['msgs_in']:.2f}/{p['msgs_out']:.2f}",
                f"{p['keepalive_msgs_in']:.2f}",
                f"{p['watch_events']:.2f}",
                f"{p['bytes_read']:.0f}",
                f"{p['bytes_written']:.0f}",
                drain,
                f"{p50:.1f}/{p99:.1f}",
            )
        )

    for w, entry in chains.items():
        for tool in TOOLS:
            e = entry[tool]
            p50, p99 = e["handoff_p50_ms"]["median"], e["handoff_p99_ms"]["median"]
            row(f"{tool} processes", w, e["etcd_per_release"], fmt(e["drain_s"], 2), p50, p99)
    for w, entry in results.get("scaling", {}).items():
        p = {k: v["median"] for k, v in entry["etcd_per_release"].items()}
        p50, p99 = entry["handoff_p50_ms"]["median"], entry["handoff_p99_ms"]["median"]
        row("conch library", w, p, fmt(entry["drain_s"], 2), p50, p99)
    diag = results.get("scaling_hold")
    if diag:
        row(
            f"conch library, {diag['hold_ms']:.0f} ms hold",
            str(diag["waiters"]),
            diag["etcd_per_release"],
            f"{diag['drain_s']:.2f}",
            diag["handoff_p50_ms"],
            diag["handoff_p99_ms"],
        )
    if srows:
        parts.append(
            "Per release (etcd /metrics delta / (W+1) releases; keepalives apart):\n"
            + render(
                (
                    "waiters",
                    "W",
                    "requests",
                    "msgs in/out",
                    "keepalives",
                    "watch events",
                    "bytes read",
                    "bytes written",
                    "drain s",
                    "handoff p50/p99 ms",
                ),
                srows,
            )
        )
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="processes carrying the library waiters of the scaling run",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--jobs", help="job lengths of the sweep, ms, comma-separated (default 0,20,...,2000)"
    )
    parser.add_argument("--reps", type=int, help="repetitions of the sweep")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"unknown sections {sorted(only - set(SECTIONS))}")
    cfg: dict[str, Any] = {
        "uncontended_reps": 5 if args.quick else 15,
        "import_reps": 3 if args.quick else 7,
        "handoff_sizes": [1, 10, 100],
        "handoff_reps": 1 if args.quick else 3,
        "sweep_jobs_ms": [int(j) for j in args.jobs.split(",")]
        if args.jobs
        else [0, 20, 50, 100, 200, 500, 1000, 2000],
        "sweep_waiters": 6 if args.quick else 10,
        "floor_processes": 5 if args.quick else 10,
        "sweep_reps": args.reps or (1 if args.quick else 3),
        "scaling_sizes": [10, 100, 1000],
        "scaling_reps": 1 if args.quick else 3,
    }
    for tool in ("bash", ETCDCTL, CONCH):
        if not shutil.which(tool):
            raise SystemExit(f"missing {tool}")

    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="conch-bench-"))
    cluster = EtcdCluster(tmp / "etcd")
    # SIGTERM/SIGHUP to the benchmark: clean up like Ctrl-C does
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cluster.start()
        endpoint = cluster.members[0].endpoint
        log.set_quiet(True)  # the holder of the scaling runs lives in this process
        bench = Bench(endpoint, tmp, args.quick)
        results: dict[str, Any] = {
            "config": {**cfg, "quick": args.quick, "workers": args.workers},
            "env": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "etcd": subprocess.run(
                    [etcd_binary(), "--version"], capture_output=True, text=True
                ).stdout.split("\n")[0],
                "etcdctl": ETCDCTL,
                "conch": CONCH,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        }
        print(f"etcd on {endpoint}; scratch {tmp}", flush=True)
        if "uncontended" in only:
            print("uncontended ...", flush=True)
            results["uncontended"] = bench.uncontended(cfg["uncontended_reps"])
            print("importtime ...", flush=True)
            results["importtime"] = bench.importtime(cfg["import_reps"])
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)

        def save() -> None:  # after each section: a failure later keeps what was measured
            out.write_text(json.dumps(results, indent=1) + "\n")

        save()
        if "floors" in only:
            print("floors: waiting processes side by side ...", flush=True)
            results["floors"] = bench.floors(cfg["floor_processes"])
            save()
        if "sweep" in only:
            print("handoff by job length, queue full ...", flush=True)
            results["sweep"] = bench.sweep(
                cfg["sweep_jobs_ms"], cfg["sweep_waiters"], cfg["sweep_reps"]
            )
            save()
        if "chains" in only:
            print("handoff chains, instant jobs ...", flush=True)
            results["handoff"] = bench.handoff(cfg["handoff_sizes"], cfg["handoff_reps"])
            save()
        if "scaling" in only:
            print("queue scaling (library waiters) ...", flush=True)
            results["scaling"] = bench.scaling(
                cfg["scaling_sizes"], cfg["scaling_reps"], args.workers
            )
            # diagnostic: the same queue when each holder keeps its slot a little while
            diag = bench.scaling_run(100, 99, args.workers, hold=0.05)
            results["scaling_hold"] = {"waiters": 100, "hold_ms": 50.0, **diag}
        results["runtime_s"] = time.monotonic() - started
        save()
        print()
        print(table(results))
        print(
            f"\n{len(PROCS)} processes started; results in {out}; "
            f"{results['runtime_s']:.0f} s in all"
        )
        return 0
    finally:
        reap_all()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
