"""A TCP proxy on loopback that holds back what the server sends by a fixed delay.

``DelayProxy(("127.0.0.1", etcd_port), delay=1.5)`` listens on ``proxy.port``; what a client
sends goes through at once, what the server answers reaches the client ``delay`` seconds
after it arrived, in order. A slow link in one direction, for the test process's own
client, without a network namespace. ``delay`` may be changed: what arrives from then on is
held back by the new one. ``cut()`` ends every connection so far, dropping what it holds back
(a link that breaks), and still accepts new ones; ``close()`` ends every connection.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable


class DelayProxy:
    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self._target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = False
        threading.Thread(target=self._accept, name="delayproxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            for target, args in (
                (_pump, (client, server)),
                (_hold, (server, held, lambda: self.delay)),
                (_release, (held, client)),
            ):
                threading.Thread(target=target, args=args, daemon=True).start()

    def cut(self) -> None:
        connections, self._sockets[1:] = self._sockets[1:], []
        _shut(connections)

    def close(self) -> None:
        self._closed = True
        _shut(self._sockets)


def _shut(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Client to server, at once."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _hold(
    source: socket.socket,
    held: queue.SimpleQueue[tuple[float, bytes]],
    delay: Callable[[], float],
) -> None:
    """Server to client: each chunk stamped with when it may go on."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            held.put((time.monotonic() + delay(), data))
    held.put((time.monotonic() + delay(), b""))


def _release(held: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))  # the delay itself, not a wait for a state
            if not data:
                sink.shutdown(socket.SHUT_WR)
                return
            sink.sendall(data)
