"""What waiting holds cost a process that embeds conch: threads and idle CPU.

    .venv/bin/python bench/embedded.py [--waiters 50] [--mode private|shared|both] [--seconds 5]

Starts a throwaway etcd (tests/etcd_server.py), blocks ``--waiters`` semaphores with a key
of no lease (a holder that never leaves), and starts one application thread per semaphore
waiting in ``acquire()`` on one shared client: each on a session of its own (``private``,
what ``Semaphore.acquire()`` does by default) or all on one ``conch.Session`` (``shared``).
Once every waiter is queued and past its first keepalive, it counts the process's threads
(Python threads and gRPC's own, from /proc/self/task) and its user + system CPU time over
``--seconds``, then prints one line per mode. The application threads themselves are
counted out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import conch
from conch import keys, log
from conch.etcd import kv
from tests.etcd_server import EtcdCluster


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def measure(cluster: EtcdCluster, mode: str, waiters: int, seconds: float) -> dict[str, float]:
    base_threads = _tasks()
    names = [f"bench-{mode}-{i}-{time.monotonic_ns()}" for i in range(waiters)]
    stop = conch.Flag("stop")
    with cluster.client() as client:
        for name in names:  # the holder that never leaves: a key of no lease, first in line
            kv.put(client, keys.sema_prefix(name, 1) + b"0", b"{}")
        session = conch.Session(client, ttl=10) if mode == "shared" else None

        def wait(name: str) -> None:
            sema = conch.Semaphore(client, name, max=1, ttl=10)
            with contextlib.suppress(conch.Interrupted):
                sema.acquire(timeout=None, interrupt=stop, **_session(session)).release()

        threads = [threading.Thread(target=wait, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(len(kv.range_prefix(client, keys.sema_prefix(n, 1)).kvs) for n in names) < (
            2 * waiters
        ):
            if time.monotonic() > deadline:
                raise SystemExit("waiters did not queue within 60 s")
            time.sleep(0.1)
        # Past the first keepalive (TTL/3), which opens each session's keepalive stream.
        time.sleep(10 / 3 + 1.5)
        threads_now = _tasks() - base_threads - waiters
        cpu_before, wall_before = _cpu(), time.monotonic()
        time.sleep(seconds)
        cpu = (_cpu() - cpu_before) / (time.monotonic() - wall_before)
        stop.set()
        for t in threads:
            t.join(30)
        if session is not None:
            session.close()
        for name in names:
            kv.delete(client, keys.name_prefix(name), kv.prefix_end(keys.name_prefix(name)))
    return {"threads": threads_now, "cpu_ms_per_s": cpu * 1000}


def _session(session: conch.Session | None) -> dict[str, conch.Session]:
    """``session=`` only when given: the same script measures code without it."""
    return {} if session is None else {"session": session}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=50)
    parser.add_argument("--mode", choices=["private", "shared", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    log.set_quiet(True)
    modes = ["private", "shared"] if args.mode == "both" else [args.mode]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp))
        cluster.start()
        try:
            for mode in modes:
                r = measure(cluster, mode, args.waiters, args.seconds)
                print(
                    f"{mode:8} waiters={args.waiters} threads={r['threads']:.0f} "
                    f"({r['threads'] / args.waiters:.2f}/waiter) "
                    f"idle_cpu={r['cpu_ms_per_s']:.1f} ms/s "
                    f"({r['cpu_ms_per_s'] / args.waiters:.3f} ms/s per waiter)",
                    flush=True,
                )
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
