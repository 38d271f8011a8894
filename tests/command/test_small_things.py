"""What a new user trips over first: NoSlot's message, --who into a closed pipe, a closed
std fd, a descriptor above the fd limit."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import conch
import conch.aio
from conch.etcd import Client, kv
from tests.conftest import Runner
from tests.etcd_server import EtcdCluster


def test_no_slot_says_it_once_in_both_faces(etcd: EtcdCluster, client: Client, name: str) -> None:
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    with sema.acquire(timeout=10):
        with pytest.raises(conch.NoSlot) as threaded:
            sema.acquire(timeout=0)

        async def from_asyncio() -> str:
            async with conch.aio.connect(etcd.endpoints) as aclient:
                try:
                    await conch.aio.Semaphore(aclient, name, max=1, ttl=5).acquire(timeout=0)
                except conch.NoSlot as exc:
                    return str(exc)
            raise AssertionError("acquired a slot that is held")

        in_asyncio = asyncio.run(from_asyncio())
    assert str(threaded.value) == f"no free slot of {name}[1] in time"
    assert in_asyncio == str(threaded.value)


def test_who_into_a_closed_pipe_exits_quietly_as_unix_tools_do(
    conch: Runner, client: Client, name: str
) -> None:
    """``conch sema NAME --who | head -1``: more records than a pipe holds (64 KiB), the
    reader gone after one line. No traceback: the status a tool killed by SIGPIPE has."""
    base = f"/conch/v1/sema/{name}/2/".encode()
    value = (
        b'{"host":"node-with-a-long-name","pid":4242,"started":"2026-06-12T10:15:00Z","cmd":"x"}'
    )
    for start in range(0, 1500, 100):
        kv.txn(
            client,
            [],
            [kv.op_put(base + b"%04x" % i, value) for i in range(start, start + 100)],
            [],
        )
    proc = conch.start("sema", name, "--max", "2", "--who")
    assert proc.process.stdout is not None
    first = proc.process.stdout.readline()
    assert first.strip()
    proc.process.stdout.close()
    assert proc.wait() == 128 + signal.SIGPIPE
    assert proc.log() == ""


@pytest.mark.parametrize("closed", ["<&-", "2>&-", "<&- >&- 2>&-"])
def test_a_std_fd_closed_by_conchs_caller_is_dev_null_in_the_child(
    conch: Runner, name: str, tmp_path: Path, closed: str
) -> None:
    """cron's ``>&-``, a daemon's closed stdin: conch puts /dev/null there, for itself and
    for the child. Before, the /dev/null that landed on the closed descriptor itself was
    close-on-exec: the child started with it closed, and the first file it opened took it
    (``2>&-``: its error messages written into its own output file)."""
    report = tmp_path / "fds"
    script = (
        "import os, sys\n"
        "out = open(sys.argv[1], 'w')\n"  # takes the lowest free descriptor
        "targets = [os.readlink(f'/proc/self/fd/{fd}') if fd != out.fileno() else 'TAKEN'\n"
        "           for fd in (0, 1, 2)]\n"
        "out.write(' '.join(targets))\n"
    )
    proc = conch.start(
        "sema", name, "--max", "1", "--", sys.executable, "-c", script, str(report),
        launcher=["sh", "-c", f'exec "$@" {closed}', "sh"],
    )  # fmt: skip
    assert proc.wait() == 0, proc.log()
    targets = report.read_text().split()
    for fd, what in enumerate(("<&-", ">&-", "2>&-")):
        if what in closed.split():
            assert targets[fd] == os.devnull, f"fd {fd} in the child: {targets}"


# Runs conch (its command line as the arguments) with an inheritable descriptor at 200 and
# the soft RLIMIT_NOFILE lowered below it: a service that raised its limit, opened many
# files, and started conch with a lower one (or a shell's fd 255 under ulimit -n 128).
HIGH_FD = """
import os, resource, sys
fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd, 200)  # inheritable
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def test_a_descriptor_above_the_fd_limit_is_closed_in_the_child_and_the_child_runs(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """Before, conch asked posix_spawn to close every descriptor it inherited, and glibc
    refuses to name one at or above the soft RLIMIT_NOFILE (EBADF): every command was
    reported as not executable, exit 126, whatever it was."""
    script = tmp_path / "high_fd.py"
    script.write_text(HIGH_FD)
    fds = tmp_path / "fds"
    proc = conch.start(
        "sema", name, "--max", "1", "--", "sh", "-c", f"ls /proc/$$/fd > {fds}",
        launcher=[sys.executable, str(script)],
    )  # fmt: skip
    assert proc.wait() == 0, proc.log()
    assert "200" not in fds.read_text().split(), "the descriptor reached the child"
