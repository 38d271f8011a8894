"""The invariant harness: K conch wrappers contend for one semaphore while a seeded schedule
injects faults; then the records the children left are checked against the contract.

Each child appends ``start|end|stop <holder> <CONCH_REV> <unix time>`` lines (``stop``: it
ended by SIGTERM; ``start`` adds the child's pid) to one file opened with O_APPEND (the
shell's ``>>``). A child SIGKILLed (conch's answer to a revoked lease, or to a deadline)
records no end of its own: the harness watches every child's pid (a pidfd) and appends
``killed <holder> <CONCH_REV> <unix time>`` when one dies; a child's own end, earlier,
counts where there is one. Faults, one at a
time, on a random running wrapper: SIGKILL, SIGSTOP for longer than the TTL then SIGCONT,
revocation of its lease from outside, SIGTERM. Checked afterwards:

* at every instant at most N children run, except within TTL + kill-after of an induced
  loss; and every child ends (every window closes);
* with N = 1, fencing tokens rise in the order the children start;
* convergence: every wrapper exits with 0, 70, 75 or 128+15 (or died of our SIGKILL), and
  no conch key is left in etcd once all have exited (a SIGKILLed wrapper's lease expires).

Run longer, with other seeds: ``scripts/harness.py --help``.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from conch import keys
from conch.etcd import kv, lease
from tests.etcd_server import EtcdCluster

FAULTS = ("sigkill", "sigstop", "revoke", "sigterm")
# -SIGTERM: the signal came while Python was still starting, before conch's handlers (nothing
# was written to etcd yet); a shell reports it as 143 too.
OK_EXITS = {0, 70, 75, 128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL}


@dataclass
class Config:
    seed: int
    max_holders: int
    workers: int = 8
    duration: float = 20.0  # seconds of fault injection
    ttl: int = 3
    kill_after: float = 1.0
    name: str = ""
    child_time: tuple[float, float] = (0.2, 0.8)  # seconds a child runs, drawn uniformly


@dataclass
class Report:
    config: Config
    faults: list[tuple[float, str]] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)
    excess: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, count
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kinds = dict(sorted(collections.Counter(f for _, f in self.faults).items()))
        widest = max((e - s for s, e, _ in self.excess), default=0.0)
        return (
            f"seed={self.config.seed} N={self.config.max_holders} K={self.config.workers} "
            f"runs={len(self.exits)} children={len(self.spans)} faults={kinds} "
            f"overlap_windows={len(self.excess)} widest_overlap={widest:.2f}s "
            f"problems={len(self.problems)}"
        )


CHILD = (
    'trap \'echo "stop $H $CONCH_REV $(date +%s.%N)" >> "$REC"; exit 143\' TERM; '
    'echo "start $H $CONCH_REV $(date +%s.%N) $$" >> "$REC"; '
    'sleep "$D" & wait $!; '
    'echo "end $H $CONCH_REV $(date +%s.%N)" >> "$REC"'
)


class Harness:
    ok_exits = OK_EXITS

    def __init__(self, config: Config, etcd: EtcdCluster, workdir: Path) -> None:
        self.config = config
        self.etcd = etcd
        self.workdir = workdir
        self.records = workdir / "records"
        self.rng = random.Random(config.seed)
        self.report = Report(config)
        self.running: dict[int, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.stop_at = 0.0
        self.workers_done = threading.Event()
        if not config.name:
            config.name = f"harness-{config.seed}-{config.max_holders}"

    def _worker(self, index: int, rng: random.Random) -> None:
        run = 0
        while time.monotonic() < self.stop_at:
            run += 1
            env = dict(os.environ)
            env.update(
                CONCH_ENDPOINTS=self.etcd.endpoints,
                REC=str(self.records),
                H=f"w{index}.{run}",
                D=f"{rng.uniform(*self.config.child_time):.3f}",
            )
            args = [
                *self.launcher(index),
                sys.executable,
                "-m",
                "conch",
                "sema",
                self.config.name,
                "--max",
                str(self.config.max_holders),
                "--ttl",
                f"{self.config.ttl}s",
                "--kill-after",
                f"{self.config.kill_after}s",
                "--wait",
                "30s",
                "--quiet",
                "--",
                "sh",
                "-c",
                CHILD,
            ]
            with (self.workdir / f"w{index}.log").open("ab") as log:
                proc = subprocess.Popen(args, env=env, stderr=log, start_new_session=True)
            with self.lock:
                self.running[index] = proc
            code = proc.wait()
            with self.lock:
                self.running.pop(index, None)
                self.report.exits.append(code)

    def launcher(self, index: int) -> list[str]:
        """The argv prefix that starts wrapper ``index`` (e.g. in a namespace of its own)."""
        return []

    def _lease_of(self, pid: int) -> int | None:
        prefix = keys.sema_prefix(self.config.name, self.config.max_holders)
        with self.etcd.client() as client:
            response = kv.range_prefix(client, prefix)
        for item in response.kvs:
            try:
                if json.loads(item.value).get("pid") == pid:
                    return int(item.lease)
            except ValueError:
                continue
        return None

    def _inject(self) -> None:
        while time.monotonic() < self.stop_at:
            time.sleep(self.rng.uniform(0.5, 2.0))
            with self.lock:
                targets = sorted(self.running.items())
            if not targets:
                continue
            _, proc = self.rng.choice(targets)
            fault = self.rng.choice(FAULTS)
            now = time.time()
            try:
                if fault == "sigkill":
                    proc.send_signal(signal.SIGKILL)
                elif fault == "sigterm":
                    proc.send_signal(signal.SIGTERM)
                elif fault == "sigstop":
                    proc.send_signal(signal.SIGSTOP)
                    time.sleep(self.config.ttl + self.rng.uniform(0.5, 1.5))
                    proc.send_signal(signal.SIGCONT)
                else:
                    lease_id = self._lease_of(proc.pid)
                    if lease_id is None:
                        continue
                    with self.etcd.client() as client:
                        lease.revoke(client, lease_id)
            except ProcessLookupError:
                continue
            self.report.faults.append((now, fault))

    def _watch_deaths(self) -> None:
        """Append ``killed`` when a child that has recorded its start dies (its pidfd is
        readable), until the workers are done and every watched child is gone. A child
        already gone when its start is read is recorded dead then: no earlier than it was."""
        poller = select.poll()
        watched: dict[int, tuple[str, str]] = {}  # pidfd -> (holder, rev)
        offset = 0
        while not (self.workers_done.is_set() and not watched):
            with self.records.open("rb") as records:
                records.seek(offset)
                chunk = records.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode().splitlines():
                words = line.split()
                if words[0] != "start" or len(words) < 5:
                    continue
                try:
                    pidfd = os.pidfd_open(int(words[4]))
                except ProcessLookupError:
                    self._killed(words[1], words[2])
                    continue
                watched[pidfd] = (words[1], words[2])
                poller.register(pidfd, select.POLLIN)
            for pidfd, _ in poller.poll(5):
                poller.unregister(pidfd)
                os.close(pidfd)
                self._killed(*watched.pop(pidfd))

    def _killed(self, holder: str, rev: str) -> None:
        with self.records.open("a") as records:
            records.write(f"killed {holder} {rev} {time.time():.6f}\n")

    def run(self) -> Report:
        self.records.touch()
        self.stop_at = time.monotonic() + self.config.duration
        watcher = threading.Thread(target=self._watch_deaths, daemon=True)
        watcher.start()
        threads = [
            threading.Thread(target=self._worker, args=(i, random.Random(self.rng.random())))
            for i in range(self.config.workers)
        ]
        for t in threads:
            t.start()
        self._inject()
        for t in threads:
            t.join(timeout=120)
            if t.is_alive():
                self.report.problems.append(f"a wrapper did not exit within 120 s{self._stacks()}")
        self.workers_done.set()
        watcher.join(timeout=30)
        self._check()
        return self.report

    def _stacks(self) -> str:
        """The Python stacks of wrappers still running (with py-spy, when installed)."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            return ""
        with self.lock:
            pids = [p.pid for p in self.running.values()]
        dumps = []
        for pid in pids:
            out = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            dumps.append(f"\n--- pid {pid}\n{out.stdout}{out.stderr}")
        return "".join(dumps)

    def _check(self) -> None:
        report, cfg = self.report, self.config
        bad_exits = sorted({c for c in report.exits if c not in self.ok_exits})
        if bad_exits:
            report.problems.append(f"unexpected wrapper exit codes {bad_exits}")
        starts: dict[tuple[str, int], float] = {}
        ends: dict[tuple[str, int], float] = {}
        for line in self.records.read_text().splitlines():
            kind, holder, rev, stamp, *_ = line.split()
            key, at = (holder, int(rev)), float(stamp)
            if kind == "start":
                starts[key] = at
            else:  # its own end, and the harness's view of its death: the earlier one
                ends[key] = min(at, ends.get(key, at))
        for key, begun in starts.items():
            if key not in ends:
                report.problems.append(f"child {key} never ended")
                continue
            report.spans.append((key[0], key[1], begun, ends[key]))
        # Sweep for instants with more than N children running (ends sort before starts).
        events = sorted(
            [(span[2], 1) for span in report.spans] + [(span[3], -1) for span in report.spans]
        )
        count, peak = 0, 0
        opened: float | None = None
        for at, delta in events:
            count += delta
            if count > cfg.max_holders:
                opened = at if opened is None else opened
                peak = max(peak, count)
            elif opened is not None:
                report.excess.append((opened, at, peak))
                opened, peak = None, 0
        for begun, ended, peak in report.excess:
            if not self._explained(begun, ended):
                report.problems.append(
                    f"{peak} children ran at once from {begun:.3f} to {ended:.3f} with no "
                    f"induced loss in the {self._window():.1f}s before"
                )
        if cfg.max_holders == 1:
            ordered = sorted(report.spans, key=lambda s: s[2])
            for before, after in itertools.pairwise(ordered):
                if after[1] <= before[1]:
                    report.problems.append(
                        f"fencing token went from {before[1]} to {after[1]} ({after[0]})"
                    )
        self._check_converged()

    def _window(self) -> float:
        """How long after an induced loss the contract lets more than N children run."""
        return self.config.ttl + self.config.kill_after + 1.0  # + 1 s: start-up on a busy host

    def _explained(self, begun: float, ended: float) -> bool:
        """Whether more than N children running from ``begun`` to ``ended`` (unix times) lies
        within the window after an induced loss."""
        losses = [t for t, f in self.report.faults if f in ("sigkill", "sigstop", "revoke")]
        return any(t <= begun and ended <= t + self._window() for t in losses)

    def _check_converged(self) -> None:
        prefix = keys.name_prefix(self.config.name)
        deadline = time.monotonic() + self.config.ttl + 10
        left: list[bytes] = []
        with self.etcd.client() as client:
            while time.monotonic() < deadline:
                response = kv.range_prefix(client, prefix)
                left = [item.key for item in response.kvs]
                if not left:
                    return
                time.sleep(0.2)
        self.report.problems.append(f"keys left in etcd after all exited: {left}")
