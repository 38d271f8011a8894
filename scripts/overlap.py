#!/usr/bin/env python3
"""Run the overlap harness (tests/overlap.py) over the whole matrix, K times each, and print
the largest overlap of children per case: every fault (member frozen, cut both ways, cut from
its peers; the target the leader and a follower; the wrapper frozen; the watchdog killed and
then the wrapper frozen), at --ttl 10s --kill-after 5s (the defaults issue 23 measured)
and at --ttl 3s --kill-after 1s, at N = 1 and N = 3. Needs root (network namespaces, iptables).

scripts/overlap.py --runs 3 --seed 1
scripts/overlap.py --runs 5 --fault member-frozen --settings long --max 1 --timelines

A case whose overlap followed a lease that etcd ended before its own promise (the lease's
remaining TTL as a healthy member reported it) is counted apart, as etcd's failure. With
--jobs J, J clusters (each in namespaces of its own) run cases side by side.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.netns import skip_reason
from tests.overlap import FAULTS, SETTINGS, Case, Lab, Result, matrix


def table(cases: list[Case], results: list[Result]) -> str:
    """One line per case: runs, how many overlapped (conch's, etcd's), the largest overlap
    among conch's, the largest in any run, and the closest a holder's child's death came to
    its successor's start (negative: after it)."""
    head = (
        f"| {'case':42} | runs | overlapped | etcd early | largest (conch) | largest (any) |"
        f" closest | etcd elections | problems |"
    )
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for case in cases:
        mine = [r for r in results if r.case == case]
        if not mine:
            continue
        conch = [r for r in mine if r.verdict == "conch"]
        etcd = [r for r in mine if r.etcd_early]
        elections = sum(1 for r in mine if r.etcd_notes)
        largest = max((r.largest for r in conch), default=0.0)
        any_run = max(r.largest for r in mine)
        problems = sum(1 for r in mine if r.problems)
        clearances = [r.clearance for r in mine if r.clearance is not None]
        closest = f"{min(clearances):6.3f}s" if clearances else "      -"
        lines.append(
            f"| {case.label:42} | {len(mine):4} | {len(conch):10} | {len(etcd):10} |"
            f" {largest:14.3f}s | {any_run:12.3f}s | {closest} | {elections:14} | {problems:8} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each case (3)")
    parser.add_argument("--seed", type=int, default=1, help="run r of a case uses seed S+r (1)")
    parser.add_argument("--fault", action="append", choices=FAULTS, help="only these faults")
    parser.add_argument(
        "--settings",
        action="append",
        choices=sorted(SETTINGS),
        help="long: --ttl 10s --kill-after 5s, short: --ttl 3s --kill-after 1s (these two by"
        " default), default: --ttl 10s and conch's own --kill-after",
    )
    parser.add_argument("--max", type=int, action="append", choices=[1, 3], help="N (1 and 3)")
    parser.add_argument("--role", action="append", choices=["leader", "follower"])
    parser.add_argument("--jobs", type=int, default=1, help="clusters side by side (1)")
    parser.add_argument(
        "--timelines",
        action="store_true",
        help="print the timeline of every run that overlapped or met an early lease end",
    )
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    cases = [
        c
        for c in matrix(
            tuple(args.max or (1, 3)),
            tuple(SETTINGS[s] for s in args.settings or ("long", "short")),
        )
        if (not args.fault or c.fault in args.fault)
        and (not args.role or c.role in args.role or c.role is None)
    ]
    todo: queue.Queue[tuple[Case, int]] = queue.Queue()
    for run in range(args.runs):
        for case in cases:
            todo.put((case, args.seed + run))
    results: list[Result] = []
    printing = threading.Lock()
    stopping = threading.Event()

    def work(index: int, tmp: Path) -> None:
        with Lab(tmp / f"lab{index}") as lab:
            while not stopping.is_set():
                try:
                    case, seed = todo.get_nowait()
                except queue.Empty:
                    return
                result = lab.run(case, seed)
                with printing:
                    results.append(result)
                    wanted = result.windows or result.etcd_early or result.etcd_notes
                    shown = result.report() if args.timelines and wanted else None
                    print(shown or result.summary(), flush=True)
                    for problem in [] if shown else result.problems:
                        print(f"  problem: {problem}", flush=True)

    with tempfile.TemporaryDirectory(prefix="conch-overlap-") as tmp:
        workers = [
            threading.Thread(target=work, args=(i, Path(tmp)), name=f"lab{i}")
            for i in range(max(1, args.jobs))
        ]
        for worker in workers:
            worker.start()
        try:
            for worker in workers:
                while worker.is_alive():
                    worker.join(timeout=1.0)
        except KeyboardInterrupt:
            print("interrupted: finishing the cases under way, then tearing down", flush=True)
            stopping.set()
            for worker in workers:
                worker.join()
    print(table(cases, results))
    bad = sum(1 for r in results if r.verdict == "conch")
    troubled = sum(1 for r in results if r.problems and not r.etcd_early)
    print(f"{bad} of {len(results)} runs had more than N children at once with no excuse")
    print(f"{troubled} of {len(results)} runs had other problems, with no early lease")
    return 1 if bad or troubled else 0


if __name__ == "__main__":
    sys.exit(main())
