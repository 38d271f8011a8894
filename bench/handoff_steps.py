"""Where a handoff's milliseconds go: timestamps at each step, conch against `etcdctl lock`.

    .venv/bin/python bench/handoff_steps.py [--waiters 8] [--job-ms 20] [--runs 3]

Starts a throwaway etcd, then, for each run, a holder and ``--waiters`` queued wrappers of
each tool (the queue full before the first release), children that stamp their start and
end (bash's $EPOCHREALTIME, as bench/run.py's). conch runs through this file, which wraps a
few of conch's internal functions to stamp each step on the same clock (so it follows their
names: a rename there needs one here):

    child end -> exit seen     the reaper thread sees the child gone (waitid), and tells the
                               supervisor's thread
    -> revoke sent             the reaper looked for escaped processes, and revokes
    -> event at the waiter     the deletion's watch event reaches the next holder's reader
    -> acquired (main thread)  the event is the main thread's: it holds
    -> spawn                   the hold checked, the watchdog told, posix_spawn called
    -> child start             bash runs and stamps

Prints each step's median over every handoff of every run, and both tools' handoffs
(child end to next child start). The stamps cost a few microseconds each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("exit-seen", "revoke", "event", "acquired", "spawn")


def traced_conch() -> None:
    """Run the conch command with the steps stamped to $HANDOFF_STEPS."""
    out = open(os.environ["HANDOFF_STEPS"], "a", buffering=1)  # noqa: SIM115

    def stamp(step: str) -> None:
        out.write(f"{step} {os.getpid()} {time.time():.6f}\n")

    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as conch.__main__
    import conch.etcd

    conch.etcd.FORK_SUPPORT_OFF = True
    from conch import cli, semaphore, supervisor
    from conch.etcd import lease, watch

    def before(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            stamp(step)
            return fn(*args, **kwargs)

        return wrapped

    def after(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            stamp(step)
            return result

        return wrapped

    on_item = watch._Hub._on_item

    def on_item_stamped(hub: Any, item: Any) -> None:
        if item.response is not None and item.response.events:
            stamp("event")
        on_item(hub, item)

    supervisor._Run._first_notice = after("exit-seen", supervisor._Run._first_notice)  # type: ignore[method-assign]
    lease.revoke = before("revoke", lease.revoke)
    watch._Hub._on_item = on_item_stamped  # type: ignore[assignment]
    semaphore._Wait.run = after("acquired", semaphore._Wait.run)  # type: ignore[method-assign]
    os.posix_spawnp = before("spawn", os.posix_spawnp)
    sys.argv = ["conch", *sys.argv[2:]]
    cli.run()


def one_run(tool: str, endpoint: str, tmp: Path, waiters: int, job: float) -> list[float]:
    """A holder and ``waiters`` queued wrappers of ``tool``; returns the child logs' stamps
    as (kind, time) in time order after the queue drained."""
    sys.path.insert(0, str(ROOT))
    from tests.etcd_server import etcdctl_binary

    log = tmp / f"{tool}.log"
    gate = tmp / f"{tool}.gate"
    os.mkfifo(gate)
    stamp = f'echo "S $EPOCHREALTIME" >> {log}'
    end = f'echo "E $EPOCHREALTIME" >> {log}'
    holder_child = ["bash", "-c", f"{stamp}; read -r _ < {gate}; {end}"]
    child = ["bash", "-c", f"{stamp}; sleep {job}; {end}" if job else f"{stamp}; {end}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = f"{ROOT}:{ROOT / 'generated'}"
    env["HANDOFF_STEPS"] = str(tmp / "steps")

    def argv(cmd: list[str]) -> list[str]:
        if tool == "conch":
            conch = [sys.executable, __file__, "--traced", "sema", "steps", "--max", "1"]
            return [*conch, "--endpoints", endpoint, "-q", "--", *cmd]
        return [etcdctl_binary(), "--endpoints", endpoint, "lock", "steps", "--", *cmd]

    def start(cmd: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv(cmd), env=env, stdout=subprocess.DEVNULL, start_new_session=True
        )

    procs = [start(holder_child)]
    try:
        deadline = time.monotonic() + 30
        while not log.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tool}: the holder did not start")
            time.sleep(0.01)
        procs += [start(child) for _ in range(waiters)]
        prefix = b"/conch/v1/sema/steps/1/" if tool == "conch" else b"steps/"
        _wait_queued(endpoint, prefix, waiters)
        with open(gate, "w") as f:
            f.write("go\n")
        for proc in procs:
            if proc.wait(timeout=60 + waiters * (2 + job)) != 0:
                raise RuntimeError(f"{tool}: a wrapper exited {proc.returncode}")
    finally:
        for proc in procs:  # by process group: the wrappers and what they started
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        os.unlink(gate)
    lines = [line.split() for line in log.read_text().splitlines()]
    log.unlink()
    return [float(t) for _, t in sorted(lines, key=lambda line: float(line[1]))]


def _wait_queued(endpoint: str, prefix: bytes, waiters: int) -> None:
    """Until the holder's and every waiter's key is under ``prefix`` and etcd has a watcher
    for each waiter (each conch and etcdctl waiter watches; a conch holder's guard, 50 ms
    into its hold, is one more)."""
    import urllib.request

    from conch.etcd import kv
    from conch.etcd.client import connect

    deadline = time.monotonic() + 60 + waiters
    with connect(endpoint) as client:
        while len(kv.range_prefix(client, prefix, keys_only=True).kvs) < waiters + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the waiters did not queue")
            time.sleep(0.1)
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name == "etcd_debugging_mvcc_watcher_total" and float(value) >= waiters:
                    time.sleep(0.5)
                    return
        time.sleep(0.1)
    raise RuntimeError("the waiters did not queue")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=8)
    parser.add_argument("--job-ms", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.etcd_server import EtcdCluster

    tmp = Path(tempfile.mkdtemp(prefix="conch-steps-"))
    cluster = EtcdCluster(tmp / "etcd")
    cluster.start()
    steps: dict[str, list[float]] = {s: [] for s in (*STEPS, "child start")}
    handoffs: dict[str, list[float]] = {"conch": [], "etcdctl": []}
    try:
        for _ in range(args.runs):
            for tool in ("etcdctl", "conch"):
                (tmp / "steps").write_text("")
                times = one_run(
                    tool, cluster.members[0].endpoint, tmp, args.waiters, args.job_ms / 1000
                )
                # starts and ends alternate: S E S E ... (one slot)
                ends, starts = times[1::2], times[2::2]
                handoffs[tool] += [(s - e) * 1000 for e, s in zip(ends, starts, strict=False)]
                if tool == "conch":
                    marks = [line.split() for line in (tmp / "steps").read_text().splitlines()]
                    for end, start in zip(ends, starts, strict=False):
                        _steps_of(end, start, marks, steps)
    finally:
        cluster.stop()
    print(f"{args.waiters} waiters, {args.job_ms:g} ms jobs, {args.runs} runs; medians, ms")
    for tool, values in handoffs.items():
        print(f"  handoff, {tool:8} {statistics.median(values):6.2f}  ({len(values)} handoffs)")
    previous = "child end"
    for step, values in steps.items():
        if values:
            print(f"  {previous:>12} -> {step:<12} {statistics.median(values):6.2f}")
        previous = step


def _steps_of(
    end: float, start: float, marks: list[list[str]], steps: dict[str, list[float]]
) -> None:
    """The steps of one handoff: the first exit seen and revoke after the child's end, the
    first process to hold after that revoke (the next holder), its last event before it
    held and its spawn (the window's other waiter gets the event too)."""
    stamps = [(name, int(pid), float(t)) for name, pid, t in marks]

    def first(step: str, after: float, pid: int | None = None) -> tuple[float, int] | None:
        found = [
            (t, p)
            for name, p, t in stamps
            if name == step and after <= t <= start and pid in (None, p)
        ]
        return min(found) if found else None

    seen = first("exit-seen", end)
    revoke = seen and first("revoke", seen[0])
    held = revoke and first("acquired", revoke[0])
    if not (seen and revoke and held):
        return
    events = [t for name, p, t in stamps if name == "event" and p == held[1]]
    event = max((t for t in events if revoke[0] <= t <= held[0]), default=None)
    spawn = first("spawn", held[0], held[1])
    if event is None or spawn is None:
        return
    at = end
    for step, t in zip(STEPS, (seen[0], revoke[0], event, held[0], spawn[0]), strict=True):
        steps[step].append((t - at) * 1000)
        at = t
    steps["child start"].append((start - at) * 1000)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--traced":
        traced_conch()
    else:
        main()
