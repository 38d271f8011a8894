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


def main() -> None:
    kill_after = float(sys.argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    os.write(1, b"R")  # running: conch starts no child before it reads this
    line = b""
    while b"\n" not in line:
        data = os.read(0, 256)
        if not data or b"x" in data:
            leave()
        line += data
    line, _, data = line.partition(b"\n")
    pgid, timeout = int(line.split()[1]), float(line.split()[2])
    deadline = time.monotonic() + timeout
    standby = None
    while True:
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
        data = os.read(0, 256)
        if not data:
            break
        if standby is None:
            deadline = time.monotonic() + timeout
    if standby is not None:
        time.sleep(max(0.0, standby - time.monotonic()))
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
    try:
        os.write(1, b"F")  # before the signal: conch must know by the time the child is gone
    except OSError:
        pass
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        sys.exit(0)
    end = time.monotonic() + kill_after
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main()
