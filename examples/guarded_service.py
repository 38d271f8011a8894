"""A service that guards a critical section with a conch semaphore.

Each round it takes one of ``--max`` slots of ``--name`` (waiting at most ``--wait``
seconds), does its work in small steps, and stops at once if the hold is lost. The work
writes the fencing token with each step, so a resource can refuse a stale holder.

    python examples/guarded_service.py --endpoints 127.0.0.1:2379 --name reports \
        --rounds 3 --journal /tmp/journal
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import conch


def do_work(hold: conch.Hold, journal: Path, steps: int) -> bool:
    """The critical section: append ``steps`` lines stamped with the fencing token; give up
    (return False) the moment the hold is lost."""
    for step in range(steps):
        if hold.lost.wait(timeout=0.05):  # also paces the work
            return False
        with journal.open("a") as out:
            out.write(f"{time.time():.6f} pid={os.getpid()} token={hold.revision} step={step}\n")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoints", default=os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379"))
    parser.add_argument("--name", default="reports")
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for a slot")
    parser.add_argument("--journal", type=Path, required=True)
    args = parser.parse_args()
    # conch logs its state transitions to the logger "conch" (INFO), one key=value line each
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    try:
        client = conch.connect(args.endpoints, dial_timeout=5.0)
    except conch.ConchError as exc:  # bad endpoints (64), no etcd within the dial timeout (69)
        print(f"guarded_service: {exc}", file=sys.stderr)
        return exc.exit_code
    with client:
        sema = conch.Semaphore(client, args.name, max=args.max, ttl=5)
        for _ in range(args.rounds):
            try:
                with sema.acquire(timeout=args.wait) as hold:
                    hold.on_lost(lambda reason: print(f"lost the slot: {reason}", flush=True))
                    done = do_work(hold, args.journal, steps=5)
                    print(f"round token={hold.revision} done={done}", flush=True)
            except conch.NoSlot:
                print("no slot in time; trying again next round", flush=True)
            except conch.HoldLost as exc:  # leaving the block after a loss says so
                print(f"round abandoned: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
