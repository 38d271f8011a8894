"""The model's interface on a real etcd: the same calls, the same protobuf messages, the
same ModelError on an error etcd answers, and the same faults made for real (the backend
filled to its quota, the member killed and started again, an answer held back by a
proxy). ``tests/core/test_model.py`` runs one operation sequence through this and through
``SimEtcd`` and requires the same answers."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from typing import Any

import grpc
from conchpb.etcdserverpb import rpc_pb2, rpc_pb2_grpc

from tests.etcd_server import EtcdCluster
from tests.sim.model import JUNK, ModelError

CALL_TIMEOUT = 10.0  # seconds; generous on the loaded test machine
LOST_AFTER = 2.0  # seconds: the deadline of a call whose answer the proxy holds back
QUOTA = 1 << 20  # bytes: --quota-backend-bytes of a member the space scenario fills
_NOSPACE, _DEACTIVATE = 1, 2  # etcd's AlarmType NOSPACE, AlarmRequest DEACTIVATE


class RealEtcd:
    """The first member of ``cluster`` (started), spoken to with the plain stubs (no conch
    client in between: its retries and failover would hide what etcd answered)."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.member = cluster.members[0]
        self._watches: dict[int, _Stream] = {}
        self._watch_counter = 0
        self._connect()

    def _connect(self) -> None:
        self.channel = grpc.insecure_channel(self.member.endpoint)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch_stub = rpc_pb2_grpc.WatchStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)

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

    def let_run(self, lease_id: int, seconds: int) -> None:
        """Let the lease's countdown run ``seconds`` on: poll (with a deadline) until etcd
        reports that many seconds fewer left than when asked first."""
        request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
        until = self.lease_time_to_live(request).TTL - seconds
        deadline = time.monotonic() + seconds + 30.0
        while until < self.lease_time_to_live(request).TTL:
            if time.monotonic() > deadline:
                raise AssertionError(f"lease {lease_id:x}: {seconds}s did not pass")
            time.sleep(0.05)

    def restart(self, down_for: float) -> None:
        """SIGKILL the member, leave it down ``down_for`` seconds (the outage itself, not a
        wait for a state), start it again on its data and wait until it answers; a new
        channel, so that gRPC's reconnect backoff does not add to the outage."""
        for stream in self._watches.values():
            stream.close()
        self.channel.close()
        self.member.kill()
        time.sleep(down_for)
        self.member.start(self.cluster.initial_cluster, state="existing")
        self.cluster.wait_healthy()
        self._connect()

    def fill_space(self) -> None:
        """Write junk at JUNK until the backend is at its quota (Maintenance.Status'
        dbSize, with a deadline), as an application gone wrong would. The refused put
        raises the alarm; one refused while the backend is still a little under the quota
        is disarmed and followed by smaller ones (a backend just under its quota still
        serves a Txn that only reads, which is not the state this makes)."""
        value = b"x" * (64 << 10)
        deadline = time.monotonic() + 60.0
        while True:
            if time.monotonic() > deadline:
                raise AssertionError("the backend did not reach its quota in 60 s")
            try:
                self.put(rpc_pb2.PutRequest(key=JUNK, value=value))
                continue
            except ModelError as error:
                if error.code != "RESOURCE_EXHAUSTED":
                    raise
            if self.status().dbSize >= QUOTA:
                return
            self._alarm(_DEACTIVATE)
            value = b"x" * 1024

    def clear_space(self) -> None:
        """The operator's way out (op-guide/maintenance.md): delete the junk, compact,
        defragment, disarm the alarm."""
        revision = self.delete_range(rpc_pb2.DeleteRangeRequest(key=JUNK)).header.revision
        self.compact(revision)
        defragment = self.channel.unary_unary(
            "/etcdserverpb.Maintenance/Defragment",
            request_serializer=None,
            response_deserializer=None,
        )
        self._call(defragment, b"")  # DefragmentRequest has no fields
        self._alarm(_DEACTIVATE)

    def answer_lost(self, method: str, request: Any) -> None:
        """Send ``request`` to ``method`` (``txn``, ``lease_revoke``, ...) through a proxy
        that, once the connection is up, holds etcd's answers back: etcd applies it, the
        client is told DEADLINE_EXCEEDED. Returns (raises that, as ModelError) once the
        write is seen applied: the revision moved on (polled, with a deadline)."""
        before = self.range(rpc_pb2.RangeRequest(key=b"/")).header.revision
        port = int(self.member.endpoint.rsplit(":", 1)[1])
        proxy = _HoldingProxy(port)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as lossy:
                kv, leases = rpc_pb2_grpc.KVStub(lossy), rpc_pb2_grpc.LeaseStub(lossy)
                kv.Range(rpc_pb2.RangeRequest(key=b"/"), timeout=CALL_TIMEOUT)  # connected
                proxy.holding.set()
                stubs = {"txn": kv.Txn, "put": kv.Put, "lease_revoke": leases.LeaseRevoke}
                try:
                    stubs[method](request, timeout=LOST_AFTER)
                    raise AssertionError("the proxy let an answer through")
                except grpc.RpcError as error:
                    lost = ModelError(error.code().name, "answer lost")
        finally:
            proxy.close()
        deadline = time.monotonic() + CALL_TIMEOUT
        while self.range(rpc_pb2.RangeRequest(key=b"/")).header.revision == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"{method} not applied in {CALL_TIMEOUT}s")
            time.sleep(0.02)
        raise lost

    def status(self) -> rpc_pb2.StatusResponse:
        return self._call(self.maintenance.Status, rpc_pb2.StatusRequest())

    def _alarm(self, action: int) -> None:
        """Maintenance.Alarm on NOSPACE for this member. conch's protos leave it out, so
        the AlarmRequest (action = 1, memberID = 2, alarm = 3, all varints) is encoded
        here."""
        member = self.status().header.member_id
        request = (
            b"\x08" + _varint(action) + b"\x10" + _varint(member) + b"\x18" + _varint(_NOSPACE)
        )
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


class _HoldingProxy:
    """A TCP proxy on loopback to etcd's ``port`` for one connection: what the client
    sends goes through; what etcd sends goes through until ``holding`` is set, and is
    dropped after (tests/delayproxy.py holds every byte, the connection's set-up too,
    which gRPC waits for before it sends a request)."""

    def __init__(self, port: int) -> None:
        self.holding = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets = [self._listener]
        threading.Thread(target=self._accept, args=(port,), daemon=True).start()

    def _accept(self, port: int) -> None:
        with contextlib.suppress(OSError):
            client, _ = self._listener.accept()
            server = socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT)
            server.settimeout(None)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            self._pump(server, client, True)

    def _pump(self, source: socket.socket, sink: socket.socket, held: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not (held and self.holding.is_set()):
                    sink.sendall(data)

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


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
