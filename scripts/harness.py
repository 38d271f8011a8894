#!/usr/bin/env python3
"""Run the invariant harness (tests/harness.py) over many seeds on a throwaway etcd.

scripts/harness.py --seeds 20 --max 1 --max 3 --duration 30
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.etcd_server import EtcdCluster
from tests.harness import Config, Harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds (default 10)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--max", type=int, action="append", help="capacity (default 1 and 3)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of faults per run")
    args = parser.parse_args()
    seeds = args.seed or [random.randrange(1 << 32) for _ in range(args.seeds)]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="conch-harness-") as tmp:
        cluster = EtcdCluster(Path(tmp) / "etcd")
        cluster.start()
        try:
            for seed in seeds:
                for max_holders in args.max or [1, 3]:
                    work = Path(tmp) / f"{seed}-{max_holders}"
                    work.mkdir()
                    config = Config(seed, max_holders, args.workers, args.duration)
                    report = Harness(config, cluster, work).run()
                    print(report.summary(), flush=True)
                    for problem in report.problems:
                        print(f"  PROBLEM: {problem}", flush=True)
                    failed += bool(report.problems)
        finally:
            cluster.stop()
    print(f"{failed} of {len(seeds) * len(args.max or [1, 3])} runs had problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
