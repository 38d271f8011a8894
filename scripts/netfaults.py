#!/usr/bin/env python3
"""Run the network-fault harness (tests/netfaults.py) over many seeds: each run on a fresh
private network of namespaces with 3 etcd members and 4 client nodes. Needs root.

scripts/netfaults.py --runs 10 --duration 120 --max 1
scripts/netfaults.py --seed 20261201 --kind slow --kind leader
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.netfaults import KINDS, Fault, run, timings
from tests.netns import skip_reason


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="how many random seeds (default 5)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--max", type=int, default=1, help="capacity N (default 1)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of faults per run")
    parser.add_argument("--kind", action="append", choices=KINDS, help="only these faults")
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    seeds = args.seed or [random.randrange(1 << 32) for _ in range(args.runs)]
    failed = 0
    faults: list[Fault] = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="conch-netfaults-") as tmp:
            harness = run(seed, args.max, Path(tmp), args.duration, kinds=tuple(args.kind or KINDS))
        print(harness.report.summary(), flush=True)
        for problem in harness.report.problems:
            print(f"  PROBLEM: {problem}", flush=True)
        failed += bool(harness.report.problems)
        faults += harness.timeline
    print(timings(faults))
    print(f"{failed} of {len(seeds)} runs had problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
