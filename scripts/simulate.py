#!/usr/bin/env python3
"""Run the recipe's simulator (tests/sim) over many seeded schedules, or replay one.

    .venv/bin/python scripts/simulate.py --seeds 20000 --start 2000   past CI's 2000 seeds
    .venv/bin/python scripts/simulate.py --replay 264                 one schedule's full trace
    --max N fixes the number of slots (else each seed draws 1 to 9); --variant NAME drives a
    broken Waiter or read plan of tests/sim/variants.py instead of the shipped one.

Exits 0 when every schedule kept every property, 1 otherwise, listing each failing seed
with the property it failed; a replay prints the trace and the failure, if any.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conch.core import codec
from conch.core import waiter as recipe
from tests.sim import variants
from tests.sim.schedule import PropertyFailed, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1000, help="how many schedules")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--replay", type=int, help="run this seed alone and print its trace")
    parser.add_argument("--max", type=int, help="slots (1-9); default: drawn from each seed")
    names = sorted([*variants.BROKEN, *variants.BROKEN_READS])
    parser.add_argument("--variant", choices=names, help="drive this broken variant")
    args = parser.parse_args()
    if args.seeds < 0 or (args.max is not None and not 1 <= args.max <= 9):
        parser.error("--seeds is 0 or more, --max from 1 to 9")
    waiter = variants.BROKEN.get(args.variant, recipe.Waiter)
    reader = variants.BROKEN_READS.get(args.variant, codec.ReadTogether)
    if args.replay is not None:
        return replay(args.replay, args.max, waiter, reader)
    started = time.monotonic()
    failed = 0
    for seed in range(args.start, args.start + args.seeds):
        try:
            run(seed, args.max, waiter, reader)
        except PropertyFailed as failure:
            failed += 1
            print(str(failure).split("\n")[0], flush=True)
    took = time.monotonic() - started
    print(f"{args.seeds - failed} of {args.seeds} schedules kept every property ({took:.1f} s)")
    return 1 if failed else 0


def replay(
    seed: int,
    max_holders: int | None,
    waiter: type[recipe.Waiter],
    reader: type[codec.ReadTogether],
) -> int:
    try:
        stats = run(seed, max_holders, waiter, reader)
    except PropertyFailed as failure:
        print("\n".join(failure.trace))
        print(f"\nFAILED {str(failure).split(chr(10))[0]}")
        return 1
    print("\n".join(stats.trace))
    print(f"\nseed {seed}: every property kept ({stats.held} held, {stats.gave_up} gave up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
