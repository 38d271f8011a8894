"""Start-up A/B: the uncontended `conch sema b --max 1 -- true` of two checkouts, interleaved.

    .venv/bin/python bench/startup.py [--old DIR] [--new DIR] [-n 12]

Starts one throwaway etcd (tests/etcd_server.py) on free loopback ports and, N times in turn,
times the import floor (`python -c "import grpc, google.protobuf"`), then the command from each
checkout (PYTHONPATH set to it, so each runs its own code). Interleaving makes the load of a
shared machine fall on both sides alike. Prints the medians and each side over the floor.
A copy of another commit to compare against: `git archive main | tar -x -C /tmp/old-startup`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.etcd_server import EtcdCluster  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds from spawn to exit; a failed run is an error, not a figure."""
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def env_for(checkout: Path | None, endpoint: str) -> dict[str, str]:
    """The environment of one side. Bytecode is written and used, as in an installed package
    (pip compiles it): with PYTHONDONTWRITEBYTECODE set, every run would compile conch's
    sources again (~40 ms on this machine) and measure the compiler, not the start-up."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if checkout is None:
        return env
    path = os.pathsep.join((str(checkout), str(checkout / "generated")))
    return {**env, "PYTHONPATH": path, "CONCH_ENDPOINTS": endpoint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/old-startup"))
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("-n", type=int, default=12, help="runs of each (default 12)")
    args = parser.parse_args()
    cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="conch-startup-")) / "etcd")
    cluster.start()
    try:
        endpoint = cluster.members[0].endpoint
        command = [sys.executable, "-m", "conch", "sema", "b", "--max", "1", "--", "true"]
        sides = {
            "floor": ([sys.executable, "-c", "import grpc, google.protobuf"], env_for(None, "")),
            "old": (command, env_for(args.old.resolve(), endpoint)),
            "new": (command, env_for(args.new.resolve(), endpoint)),
        }
        times: dict[str, list[float]] = {side: [] for side in sides}
        for argv, env in sides.values():  # warm the page cache and .pyc files, untimed
            timed(argv, env)
        for _ in range(args.n):
            for side, (argv, env) in sides.items():
                times[side].append(timed(argv, env))
    finally:
        cluster.stop()
    floor = statistics.median(times["floor"])
    for side, values in times.items():
        median = statistics.median(values)
        over = (median - floor) * 1000
        print(
            f"{side:5}  median {median * 1000:6.1f} ms  over floor {over:+6.1f} ms"
            f"  [{min(values) * 1000:.0f}-{max(values) * 1000:.0f}]"
        )


if __name__ == "__main__":
    main()
