"""The floor under conch's figures: what any Python etcd client written with grpcio pays
before a line of its own, run by bench/run.py beside conch and `etcdctl lock`.

    python bench/floor.py once ENDPOINT        # start, dial, one call (Maintenance.Status), exit
    python bench/floor.py wait ENDPOINT KEY    # dial, watch KEY, keep a lease alive; wait
    python bench/floor.py lock ENDPOINT NAME -- CMD...   # `etcdctl lock`'s recipe on grpcio

``once`` imports grpc and the generated etcd stubs (and with them protobuf's runtime), opens
a channel and makes one call: the start-up any gRPC etcd client has, whatever it then does.
``wait`` is a waiter reduced to what a waiting conch must keep open: one channel, a Watch
stream with one watch and a LeaseKeepAlive stream (a keepalive every TTL/3 of a 10 s lease),
each read by a thread, gRPC's stream polling set as the command sets it. It never writes a
key: the lease holds nothing. ``lock`` is `etcdctl lock` (etcd's concurrency.Mutex) written
on grpcio, as plainly as it goes: a key NAME/LEASE on a kept-alive lease, then until no key
of NAME was created before ours, watch the deletion of the last one before it; run CMD,
revoke the lease. Its handoff is the least a Python client pays for etcdctl's own path.
Nothing of conch is imported.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
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


def lock(endpoint: str, name: str, argv: list[str]) -> None:
    grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0
    channel = grpc.insecure_channel(endpoint)
    kv = rpc_pb2_grpc.KVStub(channel)
    leases = rpc_pb2_grpc.LeaseStub(channel)
    lease = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=TTL), timeout=5).ID
    keepalives: queue.SimpleQueue[object] = queue.SimpleQueue()
    answers = leases.LeaseKeepAlive(iter(keepalives.get, None))
    threading.Thread(target=lambda: [None for _ in answers], daemon=True).start()

    def keep_alive() -> None:
        while True:
            keepalives.put(rpc_pb2.LeaseKeepAliveRequest(ID=lease))
            time.sleep(TTL / 3)

    threading.Thread(target=keep_alive, daemon=True).start()
    prefix = f"{name}/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    key = prefix + f"{lease:x}".encode()
    put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, lease=lease))
    mine = kv.Txn(rpc_pb2.TxnRequest(success=[put]), timeout=5).header.revision
    watches: queue.SimpleQueue[object] = queue.SimpleQueue()
    events: queue.SimpleQueue[rpc_pb2.WatchResponse] = queue.SimpleQueue()
    stream = rpc_pb2_grpc.WatchStub(channel).Watch(iter(watches.get, None))

    def read() -> None:
        for response in stream:
            events.put(response)

    threading.Thread(target=read, daemon=True).start()
    while True:
        before = kv.Range(
            rpc_pb2.RangeRequest(
                key=prefix,
                range_end=end,
                max_create_revision=mine - 1,
                sort_order=rpc_pb2.RangeRequest.DESCEND,
                sort_target=rpc_pb2.RangeRequest.CREATE,
                limit=1,
                keys_only=True,
            ),
            timeout=5,
        )
        if not before.kvs:
            break
        create = rpc_pb2.WatchCreateRequest(
            key=before.kvs[0].key,
            start_revision=before.header.revision + 1,
            filters=[rpc_pb2.WatchCreateRequest.NOPUT],
        )
        watches.put(rpc_pb2.WatchRequest(create_request=create))
        while not events.get().events:  # the "created" answer, then the deletion
            pass
    child = os.posix_spawnp(argv[0], argv, os.environ)
    os.waitpid(child, 0)
    leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=5)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "once":
        once(sys.argv[2])
    elif sys.argv[1] == "wait":
        wait(sys.argv[2], sys.argv[3].encode())
    else:
        lock(sys.argv[2], sys.argv[3], sys.argv[5:])
