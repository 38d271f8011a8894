"""Where a handoff's milliseconds go: timestamps at each step, conch against `etcdctl lock`.

    .venv/bin/python bench/handoff_steps.py [--waiters 8] [--job-ms 20] [--runs 3]

Starts a throwaway etcd, then, for each run, a holder and ``--waiters`` queued wrappers of
each tool (the queue full before the first release), children that stamp their start and
end (bash's $EPOCHREALTIME, as bench/run.py's). conch runs through this file, which wraps a
few of conch's internal functions to stamp each step on the same clock (so it follows their
names: a rename there needs one here):

    child end -> exit seen     the reaper thread sees the child gone (waitid)
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
import os
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
        out.write(f"{step} {time.time():.6f}\n")

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

    supervisor._child_exited = before("exit-seen", supervisor._child_exited)
    lease.revoke = before("revoke", lease.revoke)
    watch._Hub._on_item = on_item_stamped  # type: ignore[assignment]
    semaphore.Semaphore._acquire = after("acquired", semaphore.Semaphore._acquire)  # type: ignore[method-assign]
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

    procs = [subprocess.Popen(argv(holder_child), env=env, stdout=subprocess.DEVNULL)]
    deadline = time.monotonic() + 30
    while not log.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tool}: the holder did not start")
        time.sleep(0.01)
    procs += [
        subprocess.Popen(argv(child), env=env, stdout=subprocess.DEVNULL) for _ in range(waiters)
    ]
    _wait_queued(endpoint, waiters)
    with open(gate, "w") as f:
        f.write("go\n")
    for proc in procs:
        if proc.wait(timeout=60 + waiters * (2 + job)) != 0:
            raise RuntimeError(f"{tool}: a wrapper exited {proc.returncode}")
    os.unlink(gate)
    lines = [line.split() for line in log.read_text().splitlines()]
    log.unlink()
    return [float(t) for _, t in sorted(lines, key=lambda line: float(line[1]))]


def _wait_queued(endpoint: str, waiters: int) -> None:
    """Until etcd has a watcher for each waiter (each conch and etcdctl waiter watches)."""
    import urllib.request

    deadline = time.monotonic() + 60 + waiters
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
    """Each step's first stamp after the previous one, within this handoff."""
    at = end
    for step in STEPS:
        found = [float(t) for name, t in marks if name == step and at <= float(t) <= start]
        if not found:
            return
        steps[step].append((min(found) - at) * 1000)
        at = min(found)
    steps["child start"].append((start - at) * 1000)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--traced":
        traced_conch()
    else:
        main()
