"""How long a crashed replica's queued waiters block a semaphore, by TTL.

    .venv/bin/python bench/crashed_replica.py --ttl 2,3,5,10 --reps 3

One slot (--max 1), held by this process. A second process (the replica) queues
``--waiters`` acquires behind it, each on a session of its own, then is SIGKILLed: its keys
stay, on leases nobody keeps alive. This process then queues one acquire of its own behind
them and releases the slot. Recovery is the time from the release to our waiter's hold:
the dead keys take the slot in turn until their leases expire (their TTL after their last
keepalive), then ours is promoted. Starts a throwaway etcd (tests/etcd_server.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import conch  # noqa: E402
from tests.etcd_server import EtcdCluster  # noqa: E402

REPLICA = """
import sys, threading, conch
client = conch.connect(sys.argv[1])
sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=int(sys.argv[3]))
for _ in range(int(sys.argv[4])):
    threading.Thread(target=sema.acquire, daemon=True).start()
threading.Event().wait()
"""


def keys(client: conch.Client, name: str) -> int:
    from conch.etcd import kv

    prefix = f"/conch/v1/sema/{name}/1/".encode()
    return len(kv.range_prefix(client, prefix, keys_only=True).kvs)


def once(etcd: EtcdCluster, client: conch.Client, ttl: int, waiters: int, rep: int) -> float:
    name = f"crash-{ttl}-{rep}-{os.getpid()}"
    sema = conch.Semaphore(client, name, max=1, ttl=ttl)
    hold = sema.acquire(timeout=10)
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, etcd.endpoints, name, str(ttl), str(waiters)]
    )
    deadline = time.monotonic() + 60
    while keys(client, name) < 1 + waiters:
        assert time.monotonic() < deadline, "the replica's waiters did not queue"
        time.sleep(0.02)
    replica.send_signal(signal.SIGKILL)
    replica.wait()
    got: list[conch.Hold] = []
    ours = threading.Thread(target=lambda: got.append(sema.acquire(timeout=ttl * 4 + 30)))
    ours.start()
    deadline = time.monotonic() + 60
    while keys(client, name) < 2 + waiters:
        assert time.monotonic() < deadline, "our waiter did not queue"
        time.sleep(0.01)
    released = time.monotonic()
    hold.release()
    ours.join()
    recovery = time.monotonic() - released
    got[0].release()
    return recovery


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", default="2,3,5,10")
    parser.add_argument("--waiters", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdCluster(Path(tmp))
        etcd.start()
        try:
            with etcd.client() as client:
                for ttl in (int(t) for t in args.ttl.split(",")):
                    runs = [once(etcd, client, ttl, args.waiters, r) for r in range(args.reps)]
                    print(
                        f"ttl={ttl}s waiters={args.waiters}: recovery median "
                        f"{statistics.median(runs):.2f}s [{min(runs):.2f}-{max(runs):.2f}]",
                        flush=True,
                    )
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
