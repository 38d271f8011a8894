"""How a call fails and is retried: the one table from a gRPC status (and etcd's words) to
conch's exceptions, for calls and streams, blocking or on a loop; and for a unary call, the
endpoint and time of each attempt, which failures fail over (UNAVAILABLE, a timeout) or
renew the token, when to give up, and the capped, jittered backoff between rounds."""

from __future__ import annotations

import random
import sys
import time
from typing import TYPE_CHECKING

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
from conch.etcd.endpoints import Endpoint, check_timeout

if TYPE_CHECKING:
    from conch.etcd.client import Client

BACKOFF_FIRST = 0.05  # seconds
BACKOFF_CAP = 1.0  # seconds
ATTEMPT_FIRST = 1.0  # seconds; see Attempts.next

_JITTER = random.Random()


def map_rpc_error(error: grpc.RpcError, endpoint: Endpoint | None = None) -> EtcdError:
    """Turn a gRPC error from etcd into the conch exception that says what happened."""
    # A blocking call's error is a grpc.Call; a grpc.aio call's (AioRpcError) is not, but
    # has the same code() and details().
    aio = sys.modules.get("grpc.aio")  # loaded by whoever made an aio call
    status = isinstance(error, grpc.Call) or (
        aio is not None and isinstance(error, aio.AioRpcError)
    )
    code = error.code() if status else grpc.StatusCode.UNKNOWN
    details = (error.details() if status else None) or str(error)
    message = f"{details} ({endpoint})" if endpoint else details
    # etcd passes a request that ran out of time inside the server back as UNKNOWN "context
    # deadline exceeded": as retryable as a timeout on our side. gRPC's "Stream removed" (an
    # RST_STREAM from a busy server, seen from etcd 3.4 under a burst of auth changes on a
    # LeaseRevoke) says nothing about the request: retried like a broken connection (every
    # call conch makes is safe to repeat).
    timed_out = ("context deadline exceeded", "request timed out", "Stream removed")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or any(
        words in details for words in timed_out
    ):
        return Unavailable(message, code.name)
    # Permissions changed since the token was issued: authenticate again. etcd says so in
    # its apply path's words, or (3.4, checks before the proposal) its gRPC error's.
    stale = ("invalid auth token", "revision in header is old", "revision of auth store is old")
    if code == grpc.StatusCode.UNAUTHENTICATED or any(words in details for words in stale):
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


class Backoff:
    """Capped exponential backoff with decorrelated jitter: ``next()`` gives the next pause
    in seconds, drawn from [``first``, 3 x the previous pause] (the first from [``first``,
    3 x ``first``]), never over ``cap``. Without jitter every waiter that saw one outage
    would retry in lockstep after it, each retry a burst on etcd. ``rng`` (a
    ``random.Random``) makes the sequence reproducible; ``reset()`` starts again from
    ``first`` (after progress)."""

    def __init__(
        self,
        first: float = BACKOFF_FIRST,
        cap: float = BACKOFF_CAP,
        rng: random.Random | None = None,
    ) -> None:
        self._first = first
        self._cap = cap
        self._last = first
        # One generator for all by default: seeding one costs tens of microseconds (from
        # os.urandom), and a Hold makes its Backoff on the handoff's path.
        self._rng = rng or _JITTER

    def next(self) -> float:
        self._last = min(self._cap, self._rng.uniform(self._first, self._last * 3))
        return self._last

    def reset(self) -> None:
        self._last = self._first


class Attempts:
    """The decisions of one unary call across its attempts, for ``Client.call`` and
    ``Client.call_async`` alike (see the module's docstring); ``timeout`` (seconds, default
    the client's ``request_timeout``) bounds the whole call."""

    def __init__(self, client: Client, timeout: float | None) -> None:
        if timeout is not None:
            check_timeout("timeout", timeout)  # nan or inf would make gRPC wait forever
        self._client = client
        total = client.request_timeout if timeout is None else timeout
        self.deadline = time.monotonic() + total
        self._backoff = Backoff()
        self._tried_in_round = self._stale_tokens = self._rounds = 0

    def left(self) -> float:
        """Seconds left until the call's deadline (negative once past)."""
        return self.deadline - time.monotonic()

    def next(self) -> tuple[Endpoint, float]:
        """The endpoint of the next attempt, and the seconds it may take there.

        With other endpoints to try, a silent member (cut off, or a leader cut from us)
        holds each attempt this long before another is asked, so it starts short
        (ATTEMPT_FIRST); it doubles each full round over the endpoints, so a link that is
        only slow still gets calls through. (An attempt of half the time left held a
        LeaseRevoke 2.5 s on an unreachable leader, and the next holder waited as long.)"""
        left = self.left()
        if len(self._client.endpoints) > 1:
            left = min(left, ATTEMPT_FIRST * 2.0 ** min(self._rounds, 6))
        return self._client.endpoint, max(left, 0.001)

    def failed(self, error: EtcdError, endpoint: Endpoint, token: str | None) -> float:
        """After an attempt on ``endpoint`` (carrying ``token``) failed with ``error``: the
        seconds to pause before the next attempt (0: at once). Raises ``error`` when it is
        not worth retrying or time is up (Unavailable when a fresh token never came)."""
        stale = isinstance(error, TokenInvalid) and token is not None
        if not (stale or isinstance(error, Unavailable)) or time.monotonic() >= self.deadline:
            if stale:
                # Out of time while renewing a token (a restarted member that forgot
                # it, a burst of auth changes): as transient as a member that is away.
                raise Unavailable(f"no fresh auth token accepted in time: {error}") from None
            raise error
        if stale:
            # Any auth change makes every JWT token issued before it stale, and a burst
            # of them can outrun any fixed number of retries: retry while time is left,
            # at once after the first stale token, then backing off.
            self._client.invalidate_token(token)
            self._stale_tokens += 1
            if self._stale_tokens == 1:
                return 0.0
        else:
            self._client.failover(endpoint)
            self._tried_in_round += 1
            if self._tried_in_round < len(self._client.endpoints):
                return 0.0
            self._tried_in_round = 0
            self._rounds += 1
        return min(self._backoff.next(), max(0.0, self.left()))
