"""The floor under conch's figures: what any Python etcd client written with grpcio pays
before a line of its own, run by bench/run.py beside conch and `etcdctl lock`.

    python bench/floor.py once ENDPOINT        # start, dial, one call (Maintenance.Status), exit
    python bench/floor.py wait ENDPOINT KEY    # dial, watch KEY, keep a lease alive; wait

``once`` imports grpc and the generated etcd stubs (and with them protobuf's runtime), opens
a channel and makes one call: the start-up any gRPC etcd client has, whatever it then does.
``wait`` is a waiter reduced to what a waiting conch must keep open: one channel, a Watch
stream with one watch and a LeaseKeepAlive stream (a keepalive every TTL/3 of a 10 s lease),
each read by a thread, gRPC's stream polling set as the command sets it. It never writes a
key: the lease holds nothing. Nothing of conch is imported.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "generated"))

import grpc  # noqa: E402
import grpc._common  # noqa: E402
from conchpb.etcdserverpb import rpc_pb2, rpc_pb2_grpc  # noqa: E402

TTL = 10  # seconds: conch's default --ttl


def once(endpoint: str) -> None:
    channel = grpc.insecure_channel(endpoint)
    rpc_pb2_grpc.MaintenanceStub(channel).Status(rpc_pb2.StatusRequest(), timeout=5)
    os._exit(0)  # as conch leaves: no interpreter teardown


def wait(endpoint: str, key: bytes) -> None:
    grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0  # as conch's command sets it (conch/cli.py)
    channel = grpc.insecure_channel(endpoint)
    lease = rpc_pb2_grpc.LeaseStub(channel).LeaseGrant(
        rpc_pb2.LeaseGrantRequest(TTL=TTL), timeout=5
    )
    requests: dict[str, queue.SimpleQueue[object]] = {
        "watch": queue.SimpleQueue(),
        "keepalive": queue.SimpleQueue(),
    }
    watch = rpc_pb2_grpc.WatchStub(channel).Watch(iter(requests["watch"].get, None))
    keepalive = rpc_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(
        iter(requests["keepalive"].get, None)
    )
    for stream in (watch, keepalive):
        threading.Thread(target=lambda s=stream: [None for _ in s], daemon=True).start()
    requests["watch"].put(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=key)))
    stop = threading.Event()
    print("ready", flush=True)
    while not stop.wait(TTL / 3):
        requests["keepalive"].put(rpc_pb2.LeaseKeepAliveRequest(ID=lease.ID))


if __name__ == "__main__":
    if sys.argv[1] == "once":
        once(sys.argv[2])
    else:
        wait(sys.argv[2], sys.argv[3].encode())
