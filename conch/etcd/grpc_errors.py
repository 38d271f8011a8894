"""What etcd's gRPC errors mean: the one table from a status (and etcd's words) to conch's
exceptions, for calls and streams, blocking or on a loop."""

from __future__ import annotations

import sys

import grpc

from conch.errors import (
    AuthenticationFailed,
    Compacted,
    EtcdError,
    LeaseNotFound,
    PermissionDenied,
    TokenInvalid,
    Unavailable,
)
from conch.etcd.endpoints import Endpoint


def map_rpc_error(error: grpc.RpcError, endpoint: Endpoint | None = None) -> EtcdError:
    """Turn a gRPC error from etcd into the conch exception that says what happened."""
    # A blocking call's error is a grpc.Call; a grpc.aio call's (AioRpcError) is not, but
    # has the same code() and details().
    status = isinstance(error, grpc.Call) or _is_aio_error(error)
    code = error.code() if status else grpc.StatusCode.UNKNOWN
    details = (error.details() if status else None) or str(error)
    where = f" ({endpoint})" if endpoint else ""
    message = f"{details}{where}"
    # etcd passes a request that ran out of time inside the server back as UNKNOWN
    # "context deadline exceeded": as retryable as a timeout on our side.
    timed_out = "context deadline exceeded" in details or "request timed out" in details
    # gRPC's "Stream removed" (an RST_STREAM from a busy server, seen from etcd 3.4 under a
    # burst of auth changes on a LeaseRevoke) says nothing about the request: retry it
    # like a broken connection (every call conch makes is safe to repeat).
    timed_out = timed_out or "Stream removed" in details
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or timed_out:
        return Unavailable(message, code.name)
    if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in details:
        return TokenInvalid(message, code.name)
    # Permissions changed since the token was issued: authenticate again. etcd says so in
    # its apply path's words, or (3.4, checks before the proposal) its gRPC error's.
    if "revision in header is old" in details or "revision of auth store is old" in details:
        return TokenInvalid(message, code.name)
    if "authentication failed" in details:
        return AuthenticationFailed(message, code.name)
    if "authentication is not enabled" in details:  # a user given to an open cluster
        return AuthenticationFailed(f"{message}: give no user", code.name)
    if code == grpc.StatusCode.PERMISSION_DENIED or "user name is empty" in details:
        return PermissionDenied(message, code.name)
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseNotFound(message, code.name)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return Compacted(message)
    return EtcdError(message, code.name)


def _is_aio_error(error: grpc.RpcError) -> bool:
    aio = sys.modules.get("grpc.aio")  # loaded by whoever made an aio call
    return aio is not None and isinstance(error, aio.AioRpcError)
