"""Delay packets by a fixed time in user space, through an NFQUEUE (this kernel has no netem).

Run inside a network namespace whose iptables send packets to ``--queue``:
``python tests/nfdelay.py --queue 7 --delay 0.1``. Each packet queued is accepted ``--delay``
seconds after it arrived, in arrival order. Prints ``ready`` once bound to the queue; on
SIGTERM lets go of the packets it holds, then exits. It speaks
nfnetlink_queue directly on a netlink socket (only the packet id is copied to user space), so
it needs nothing but the standard library and root in the namespace.
"""

from __future__ import annotations

import argparse
import collections
import errno
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    # nfgenmsg: family (AF_UNSPEC), version (NFNETLINK_V0), resource id (the queue, big-endian)
    payload = struct.pack("=BB", 0, 0) + struct.pack(">H", queue) + attrs
    header = struct.pack("=IHHII", 16 + len(payload), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0)
    return header + payload


def _messages(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram."""
    out = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        out.append((kind, data[offset + 16 : offset + length]))
        offset += (length + 3) & ~3
    return out


def _packet_id(payload: bytes) -> int | None:
    offset = 4  # after nfgenmsg
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            return None
        if kind & 0x7FFF == NFQA_PACKET_HDR:
            return int(struct.unpack_from(">I", payload, offset + 4)[0])
        offset += (length + 3) & ~3
    return None


def _configure(sock: socket.socket, queue: int) -> None:
    """Bind the queue and ask for metadata only; raise OSError if the kernel refuses."""
    bind = _attr(NFQA_CFG_CMD, struct.pack("=BB", NFQNL_CFG_CMD_BIND, 0) + struct.pack(">H", 2))
    params = _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
    for attrs in (bind, params):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        for kind, payload in _messages(sock.recv(65536)):
            if kind == NLMSG_ERROR:
                code = struct.unpack_from("=i", payload)[0]
                if code:
                    raise OSError(-code, f"nfqueue {queue}: {errno.errorcode.get(-code, code)}")


def run(queue: int, delay: float, stopping: list[bool]) -> None:
    """Serve ``queue`` until ``stopping[0]`` is true and every packet read has been let go."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((0, 0))
    _configure(sock, queue)
    print("ready", flush=True)
    due: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        if stopping[0]:
            timeout = 0.0 if not due else timeout
        readable, _, _ = select.select([sock], [], [], 0.2 if timeout is None else timeout)
        if stopping[0] and not due and not readable:
            return
        if readable:
            try:
                data = sock.recv(65536)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:  # overrun: those packets stay queued
                    raise
                continue
            for kind, payload in _messages(data):
                packet = _packet_id(payload) if kind & 0xFF == NFQNL_MSG_PACKET else None
                if packet is not None:
                    due.append((time.monotonic() + delay, packet))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, packet = due.popleft()
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet))
            sock.send(_message(NFQNL_MSG_VERDICT, queue, verdict))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay", type=float, required=True, help="seconds")
    args = parser.parse_args()
    stopping = [False]  # SIGTERM: let go of what is held, then exit

    def stop(*_: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, stop)
    run(args.queue, args.delay, stopping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
