"""What a new user trips over first: NoSlot's message, --who into a closed pipe."""

from __future__ import annotations

import asyncio
import signal

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
