"""The watchdog process itself (``conch.watchdog``; its protocol is the table in
docs/design.md, "The watchdog"): ``python -I -S _watchdog_main.py``, standard library only,
nothing imported from conch, not even contextlib (10 ms of imports for every conch start).
Every instant is ``time.monotonic()``, one clock for the whole host on Linux."""

import os
import select
import signal
import time

# Seconds a frozen wrapper's SIGTERM comes after the one a live wrapper would send at the
# same deadline: the two never both reach the child's cleanup. The SIGKILL is not delayed.
TERM_LAG = 0.2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Seconds after goodbye to wait for conch to close the pipe (once its release is out) before
# exiting: the exit would compete with the next holder's start for the CPU.
LINGER = 0.2


class Pipe:
    """conch's commands on stdin, a line at a time."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def line(self, until: "float | None") -> "list[bytes] | None":
        """The next command's words; None at ``until`` with no line complete; [] once the
        pipe is closed (conch died, or closed it after goodbye)."""
        while b"\n" not in self.data:
            if self.closed:
                return []
            wait = None if until is None else max(0.0, until - time.monotonic())
            if not select.select([0], [], [], wait)[0]:
                return None
            more = os.read(0, 4096)
            self.closed = not more
            self.data += more
        line, _, self.data = self.data.partition(b"\n")
        return line.split() or [b"?"]


def leave(pipe: Pipe) -> None:  # exit once conch closes the pipe, at most LINGER later
    until = time.monotonic() + LINGER
    while pipe.line(until) not in (None, []):
        pass
    os._exit(0)


def marked(marks: "set[bytes]") -> "set[int]":
    """The process groups of every process whose environment holds all of ``marks``: the
    child and whatever it started (the ones that left its group too), found without its pid."""
    groups = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/" + name + "/environ", "rb") as environ:
                if marks <= set(environ.read().split(b"\0")):
                    groups.add(os.getpgid(int(name)))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return groups


def signal_groups(pgids: "set[int]", sig: int) -> "set[int]":  # those that still exist
    left = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
            left.add(pgid)
        except ProcessLookupError:
            pass
    return left


def say(what: bytes) -> None:  # to conch, which may be gone
    try:
        os.write(1, what)
    except OSError:
        pass


def terminate(pgids: "set[int]", kill_at: float, term: bool = True) -> None:
    """SIGTERM the groups now (if ``term``), SIGKILL what is left of them at ``kill_at``,
    then exit."""
    if term:
        say(b"F")  # before the signal: conch must know by the time the child is gone
        pgids = signal_groups(pgids, signal.SIGTERM)
    while pgids and time.monotonic() < kill_at:
        time.sleep(min(0.05, max(0.0, kill_at - time.monotonic())))
        pgids = signal_groups(pgids, 0)
    signal_groups(pgids, signal.SIGKILL)
    os._exit(0)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    # SIGCONT from the kernel when conch dies: a watchdog stopped by someone's SIGSTOP, its
    # conch SIGKILLed before it noticed, resumes and finds the end of its pipe. Before the R:
    # no child starts without it. Best effort off Linux.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGCONT, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass
    os.write(1, b"R")  # running: conch starts no child before it reads this
    words = (pipe := Pipe()).line(None)
    if not words or words[0] != b"e":
        leave(pipe)
    assert words is not None
    margin, expiry, kill_after = (float(word) for word in words[1:4])
    marks = set(words[4:])
    pgid = None
    standby = None  # conch terminates the group itself; SIGKILL is ours at this instant
    while True:
        kill_at = expiry - margin
        until = kill_at - kill_after + TERM_LAG if standby is None else standby
        words = pipe.line(min(kill_at, until))
        if not words:
            break  # the deadline (conch frozen), or conch died
        if words[0] == b"x":
            leave(pipe)
        elif words[0] == b"p":
            say(b"A")
        elif words[0] == b"h":
            expiry = max(expiry, float(words[1]))
        elif words[0] == b"a":
            pgid, expiry = int(words[1]), max(expiry, float(words[2]))
        elif words[0] == b"s":  # SIGKILL ours a second after conch's own, unless goodbye
            standby = float(words[1]) + 1.0
    # Between the child's start and the arm line (conch killed right there) only the marks
    # tell which processes are the child's.
    pgids = {pgid} if pgid is not None else marked(marks)
    if standby is not None:  # conch frozen or dead while it stopped the group itself
        terminate(pgids, min(kill_at, standby), term=False)
    # conch died (the pipe closed): the grace it would have given, within the deadline.
    terminate(pgids, min(kill_at, time.monotonic() + kill_after))


if __name__ == "__main__":
    main()
