"""The model's interface on a real etcd: the same calls, the same protobuf messages, the
same ModelError on an error etcd answers. The comparison tests run one operation sequence
through this and through ``SimEtcd`` and require the same answers."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
from conchpb.etcdserverpb import rpc_pb2, rpc_pb2_grpc

from tests.sim.model import ModelError

CALL_TIMEOUT = 10.0  # seconds; generous on the loaded test machine


class RealEtcd:
    """One etcd member at ``target`` (host:port), spoken to with the plain stubs (no conch
    client in between: its retries and failover would hide what etcd answered)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch_stub = rpc_pb2_grpc.WatchStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        self._watches: dict[int, _Stream] = {}
        self._watch_counter = 0

    def close(self) -> None:
        for stream in self._watches.values():
            stream.close()
        self.channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as error:
            raise ModelError(error.code().name, error.details() or "") from None

    def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        return self._call(self.kv.Range, request)

    def put(self, request: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        return self._call(self.kv.Put, request)

    def delete_range(self, request: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        return self._call(self.kv.DeleteRange, request)

    def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        return self._call(self.kv.Txn, request)

    def compact(self, revision: int) -> rpc_pb2.CompactionResponse:
        return self._call(self.kv.Compact, rpc_pb2.CompactionRequest(revision=revision))

    def lease_grant(self, request: rpc_pb2.LeaseGrantRequest) -> rpc_pb2.LeaseGrantResponse:
        return self._call(self.lease.LeaseGrant, request)

    def lease_revoke(self, request: rpc_pb2.LeaseRevokeRequest) -> rpc_pb2.LeaseRevokeResponse:
        return self._call(self.lease.LeaseRevoke, request)

    def lease_keepalive(
        self, request: rpc_pb2.LeaseKeepAliveRequest
    ) -> rpc_pb2.LeaseKeepAliveResponse:
        try:
            responses = self.lease.LeaseKeepAlive(iter([request]), timeout=CALL_TIMEOUT)
            return next(iter(responses))
        except grpc.RpcError as error:
            raise ModelError(error.code().name, error.details() or "") from None

    def lease_time_to_live(
        self, request: rpc_pb2.LeaseTimeToLiveRequest
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        return self._call(self.lease.LeaseTimeToLive, request)

    def expire(self, lease_id: int, ttl: int) -> None:
        """Let the lease run out: poll (deadline: the TTL plus a generous margin) until
        etcd says it is gone."""
        deadline = time.monotonic() + ttl + 30.0
        request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
        while self.lease_time_to_live(request).TTL != -1:
            if time.monotonic() > deadline:
                raise AssertionError(f"lease {lease_id:x} still granted after {ttl + 30}s")
            time.sleep(0.05)

    def set_nospace(self, on: bool) -> None:
        """Raise or clear the NOSPACE alarm, as etcd raises it itself when its backend is
        over quota: Maintenance.Alarm, ACTIVATE (1) or DEACTIVATE (2) of NOSPACE (1) on this
        member. conch's protos leave Maintenance.Alarm out, so the AlarmRequest (action = 1,
        memberID = 2, alarm = 3, all varints) is encoded here."""
        member = self.range(rpc_pb2.RangeRequest(key=b"/")).header.member_id
        action = 1 if on else 2
        request = b"\x08" + _varint(action) + b"\x10" + _varint(member) + b"\x18" + _varint(1)
        alarm = self.channel.unary_unary(
            "/etcdserverpb.Maintenance/Alarm",
            request_serializer=None,
            response_deserializer=None,
        )
        self._call(alarm, request)

    def watch_create(self, request: rpc_pb2.WatchCreateRequest) -> int:
        self._watch_counter += 1
        stream = _Stream(self.watch_stub, request)
        self._watches[self._watch_counter] = stream
        return self._watch_counter

    def watch_next(self, watch_id: int, revisions: int = 1) -> rpc_pb2.WatchResponse | None:
        """The watcher's next response, waited for (``CALL_TIMEOUT``); None if none came."""
        del revisions  # etcd decides how many revisions go in one response
        return self._watches[watch_id].next(CALL_TIMEOUT)

    def watch_cancel(self, watch_id: int) -> None:
        self._watches.pop(watch_id).close()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


class _Stream:
    """One Watch.Watch stream carrying one watcher; responses read into a queue by gRPC's
    own iterator, taken with a deadline."""

    def __init__(self, stub: rpc_pb2_grpc.WatchStub, request: rpc_pb2.WatchCreateRequest) -> None:
        self._requests: queue.SimpleQueue[rpc_pb2.WatchRequest | None] = queue.SimpleQueue()
        self._requests.put(rpc_pb2.WatchRequest(create_request=request))
        self._call = stub.Watch(iter(self._requests.get, None))
        self._responses: queue.SimpleQueue[rpc_pb2.WatchResponse] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
        except grpc.RpcError:
            pass  # cancelled by close()

    def next(self, timeout: float) -> rpc_pb2.WatchResponse | None:
        try:
            return self._responses.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
