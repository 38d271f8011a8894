"""KV calls (Range, Put, DeleteRange, Txn) and the compare/op builders for Txn."""

from __future__ import annotations

from typing import Any, cast

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.etcd.client import Client
from conch.flag import Flag

CREATE = rpc_pb2.RangeRequest.CREATE  # sort_target: by create_revision
ASCEND = rpc_pb2.RangeRequest.ASCEND
DESCEND = rpc_pb2.RangeRequest.DESCEND


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes ``[prefix, end)`` cover exactly the keys under ``prefix``."""
    stem = prefix.rstrip(b"\xff")  # a 0xff byte cannot be raised: the one before it is
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else b"\0"  # no stem: every key


def range_(
    client: Client,
    request: rpc_pb2.RangeRequest,
    timeout: float | None = None,
    interrupt: Flag | None = None,
) -> rpc_pb2.RangeResponse:
    """KV.Range, linearizable unless the request says serializable; ``interrupt`` as in
    ``Client.call``."""
    response = client.call("kv", "Range", request, timeout, interrupt=interrupt)
    return cast(rpc_pb2.RangeResponse, response)


def range_prefix(client: Client, prefix: bytes, **fields: Any) -> rpc_pb2.RangeResponse:
    """KV.Range over every key under ``prefix``; ``fields`` are further RangeRequest fields
    (``limit``, ``revision``, ``keys_only``, ``max_create_revision``, ``sort_target``, ...)."""
    return range_(client, prefix_request(prefix, **fields))


def get(client: Client, key: bytes, timeout: float | None = None) -> kv_pb2.KeyValue | None:
    """The key's current KeyValue, or None when absent (KV.Range)."""
    response = range_(client, rpc_pb2.RangeRequest(key=key), timeout)
    return response.kvs[0] if response.kvs else None


def put(
    client: Client, key: bytes, value: bytes, lease: int = 0, timeout: float | None = None
) -> rpc_pb2.PutResponse:
    """KV.Put, attached to ``lease`` when non-zero."""
    request = rpc_pb2.PutRequest(key=key, value=value, lease=lease)
    return cast(rpc_pb2.PutResponse, client.call("kv", "Put", request, timeout))


def delete(client: Client, key: bytes, range_end: bytes = b"") -> rpc_pb2.DeleteRangeResponse:
    """KV.DeleteRange of one key, or of ``[key, range_end)``."""
    request = rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end)
    return cast(rpc_pb2.DeleteRangeResponse, client.call("kv", "DeleteRange", request))


def txn(
    client: Client,
    compare: list[rpc_pb2.Compare],
    success: list[rpc_pb2.RequestOp],
    failure: list[rpc_pb2.RequestOp],
    timeout: float | None = None,
    interrupt: Flag | None = None,
) -> rpc_pb2.TxnResponse:
    """KV.Txn: if every compare holds, run ``success``, else ``failure``, atomically;
    ``interrupt`` as in ``Client.call``."""
    request = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
    response = client.call("kv", "Txn", request, timeout, interrupt=interrupt)
    return cast(rpc_pb2.TxnResponse, response)


def create_revision_is(key: bytes, revision: int) -> rpc_pb2.Compare:
    """Compare: the key's create_revision equals ``revision`` (0 means the key is absent)."""
    return rpc_pb2.Compare(
        result=rpc_pb2.Compare.EQUAL,
        target=rpc_pb2.Compare.CREATE,
        key=key,
        create_revision=revision,
    )


def prefix_request(prefix: bytes, **fields: Any) -> rpc_pb2.RangeRequest:
    """A RangeRequest over every key under ``prefix`` with further ``fields``."""
    return rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix), **fields)


# The operations of a Txn's success or failure branch.
def op_put(key: bytes, value: bytes, lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def op_range(request: rpc_pb2.RangeRequest) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=request)


def op_delete(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))
