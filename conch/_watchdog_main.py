"""The watchdog process itself (see ``conch.watchdog``): run as a script,
``python -I -S _watchdog_main.py KILL_AFTER``, standard library only, nothing imported from
conch, not even contextlib (10 ms of imports for every conch start). It reads conch's pipe on
stdin; the protocol is described in ``conch.watchdog``."""

import os
import select
import signal
import sys
import time


def leave() -> None:
    # Goodbye comes as conch releases its slot and the next holder starts: exiting a moment
    # later keeps this process's teardown from competing with that start for the CPU.
    time.sleep(0.2)
    os._exit(0)


def read_line(data: bytes) -> "tuple[bytes, bytes]":
    """The next line from conch (after ``data``, read already) and what follows it; leaves on
    end of file or goodbye before it (no line holds the goodbye byte)."""
    while b"\n" not in data:
        if b"x" in data:
            leave()
        more = os.read(0, 256)
        if not more:
            leave()
        data += more
    line, _, rest = data.partition(b"\n")
    return line, rest


def marked(marks: "set[bytes]") -> "set[int]":
    """The process groups of every process whose environment holds all of ``marks``: the
    child and whatever it started (the ones that left its group too), found without its pid."""
    groups = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as environ:
                if marks <= set(environ.read().split(b"\0")):
                    groups.add(os.getpgid(int(name)))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return groups


def signal_groups(pgids: "set[int]", sig: int) -> "set[int]":
    """Send ``sig`` to each group; return those that still exist."""
    left = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
            left.add(pgid)
        except ProcessLookupError:
            pass
    return left


def main() -> None:
    kill_after = float(sys.argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    os.write(1, b"R")  # running: conch starts no child before it reads this
    # "e TIMEOUT NAME=VALUE...": a child with these environment entries is about to start.
    line, data = read_line(b"")
    words = line.split()
    timeout, marks = float(words[1]), set(words[2:])
    deadline = time.monotonic() + timeout
    pgid = None
    standby = None
    while True:
        if pgid is None and b"\n" in data:  # "a PGID": the child runs in that group
            line, _, data = data.partition(b"\n")
            pgid = int(line.split()[1])
        if b"x" in data:
            leave()
        if b"s" in data and standby is None:
            # conch terminates the group itself now: SIGTERM, SIGKILL kill_after later. If
            # it has not said goodbye a second after that (frozen or dead), SIGKILL is ours.
            standby = time.monotonic() + kill_after + 1.0
        until = deadline if standby is None else standby
        ready, _, _ = select.select([0], [], [], max(0.0, until - time.monotonic()))
        if not ready:
            break
        more = os.read(0, 256)
        if not more:
            break
        data = data + more if pgid is None else more
        if standby is None:
            deadline = time.monotonic() + timeout
    # conch is dead or frozen. Between the child's start and the arm line (conch killed
    # right there) only the marks tell which processes are the child's.
    pgids = {pgid} if pgid is not None else marked(marks)
    if standby is not None:
        time.sleep(max(0.0, standby - time.monotonic()))
        signal_groups(pgids, signal.SIGKILL)
        sys.exit(0)
    try:
        os.write(1, b"F")  # before the signal: conch must know by the time the child is gone
    except OSError:
        pass
    pgids = signal_groups(pgids, signal.SIGTERM)
    end = time.monotonic() + kill_after
    while pgids and time.monotonic() < end:
        time.sleep(0.05)
        pgids = signal_groups(pgids, 0)
    signal_groups(pgids, signal.SIGKILL)


if __name__ == "__main__":
    main()
