"""A worker of the queue-scaling benchmark: ``n`` library waiters in one process.

    python bench/waiters.py ENDPOINT NAME N TTL OUT_JSON TIMEOUT [HOLD_SECONDS]

Each waiter is a thread running ``Semaphore(client, NAME, max=1, ttl=TTL).acquire()`` on a
client shared by the process (its own session: lease, keepalive stream, watch), exactly what
``conch sema`` does before it would start the child. On acquiring it stamps the wall clock
and releases after HOLD_SECONDS (default 0: the child is empty). When every waiter is done
(or TIMEOUT seconds have passed) the stamps go to OUT_JSON as
``{"acquired": [...], "errors": [...]}``.

1000 separate ``conch`` processes would need ~40 GB; a handful of these workers carry 1000
waiters in ~1 GB. The etcd requests per waiter are the same as the command's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conch import log
from conch.etcd.client import connect
from conch.semaphore import Semaphore


def main() -> int:
    endpoint, name, count, ttl, out, timeout = sys.argv[1:7]
    n, deadline = int(count), time.monotonic() + float(timeout)
    hold_for = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    log.set_quiet(True)
    threading.stack_size(512 * 1024)  # 3 threads per waiter (session, keepalive, watch)
    acquired: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    with connect(endpoint, dial_timeout=10.0, request_timeout=30.0) as client:

        def waiter() -> None:
            try:
                hold = Semaphore(client, name, 1, int(ttl)).acquire(
                    timeout=max(1.0, deadline - time.monotonic())
                )
                stamp = time.time()
                if hold_for:
                    time.sleep(hold_for)
                hold.release()
                with lock:
                    acquired.append(stamp)
            except Exception as exc:  # reported to the orchestrator, which fails the run
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in threads)
        if alive:
            errors.append(f"{alive} waiters still waiting at the timeout")
    Path(out).write_text(json.dumps({"acquired": acquired, "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a grpc stream collected during finalization can deadlock
    # (grpc _Rendezvous.__del__); the command-line runs measure that, this worker does not.
    os._exit(code)
