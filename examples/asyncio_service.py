"""An asyncio service that guards a critical section with a conch semaphore.

A tiny HTTP/1.0 server: each request takes one of ``--max`` slots of ``--name`` (waiting at
most ``--wait`` seconds), does its work in small steps, and stops at once if the hold is
lost. The work writes the fencing token with each step, so a resource can refuse a stale
holder. Answers ``200 token=N``, ``503`` (no slot in time) or ``409`` (the hold was lost).
SIGTERM or SIGINT stops it: requests still waiting withdraw their keys, those holding
release them.

    python examples/asyncio_service.py --endpoints 127.0.0.1:2379 --name reports \
        --journal /tmp/journal --port 8080
    curl http://127.0.0.1:8080/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import conch
import conch.aio


def append(journal: Path, line: str) -> None:
    with journal.open("a") as out:
        out.write(line)


async def do_work(hold: conch.aio.Hold, journal: Path, steps: int) -> bool:
    """The critical section: append ``steps`` lines stamped with the fencing token; give up
    (return False) the moment the hold is lost."""
    for step in range(steps):
        with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11
            await asyncio.wait_for(hold.lost.wait(), 0.05)  # also paces the work
        if hold.lost.is_set():
            return False
        await hold.check()  # raises HoldLost if the lease is not certainly alive now
        line = f"{time.time():.6f} pid={os.getpid()} token={hold.revision} step={step}\n"
        # Blocking file I/O goes to the default executor, as a web framework's would.
        await asyncio.to_thread(append, journal, line)
    return True


class Service:
    def __init__(self, sema: conch.aio.Semaphore, journal: Path, wait: float) -> None:
        self.sema = sema
        self.journal = journal
        self.wait = wait

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readline()).strip():
                pass  # the request line and headers: every request does the same work
            try:
                status, body = await self.guarded_work()
            except asyncio.CancelledError:
                # Stopping (only the service cancels its handlers): the key of a waiting
                # request is withdrawn, a slot held is released, by the time we get here.
                status, body = "503 Service Unavailable", "stopping"
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\n\r\n{body}\n".encode())
            await writer.drain()
        finally:
            writer.close()

    async def guarded_work(self) -> tuple[str, str]:
        try:
            async with self.sema.acquire(timeout=self.wait) as hold:
                done = await do_work(hold, self.journal, steps=5)
                return ("200 OK", f"token={hold.revision}") if done else ("409 Conflict", "lost")
        except conch.NoSlot:
            return "503 Service Unavailable", "no slot in time"
        except conch.HoldLost as exc:
            return "409 Conflict", f"lost: {exc}"


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    # As small as it gets, to show it: conch.aio never uses the loop's default executor.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        connecting = conch.aio.connect(args.endpoints, dial_timeout=5.0)
        client = await connecting
    except conch.ConchError as exc:  # bad endpoints (64), no etcd within the dial timeout (69)
        print(f"asyncio_service: {exc}", file=sys.stderr)
        return exc.exit_code
    async with client:
        sema = conch.aio.Semaphore(client, args.name, max=args.max, ttl=5)
        service = Service(sema, args.journal, args.wait)
        handlers: set[asyncio.Task[None]] = set()

        async def track(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            try:
                await service.handle(reader, writer)
            finally:
                handlers.discard(task)

        server = await asyncio.start_server(track, "127.0.0.1", args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"listening on 127.0.0.1:{port}", flush=True)
        async with server:
            await stop.wait()
            server.close()
            # Cancelled handlers withdraw their keys (or release their slots) before they end.
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
    print("stopped", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoints", default=os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379"))
    parser.add_argument("--name", default="reports")
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for a slot")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--journal", type=Path, required=True)
    args = parser.parse_args()
    # conch logs its state transitions to the logger "conch" (INFO), one key=value line each
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
