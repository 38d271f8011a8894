"""The connection to an etcd cluster: endpoints, deadlines, failover, and how a call fails.

Every unary call carries a deadline; one that fails with UNAVAILABLE or runs out its
per-attempt time is tried again on the next endpoint (``Attempts``, with a capped, jittered
``Backoff`` between rounds) until then. Streams run on the current endpoint; their owners
re-open them after a failure, on the next one. With credentials, calls and streams carry an
auth token; etcd refuses a stale one (expired, issued before an auth change, unknown to a
member that restarted): one thread then authenticates for all (``Client.token``), and the
call is retried within its deadline. ``map_rpc_error`` is the one table from a gRPC status
(and etcd's words) to conch's exceptions, for calls and streams, blocking or on a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
import grpc.aio
from conchpb.etcdserverpb import rpc_pb2

from conch.errors import (
    AuthenticationFailed,
    Compacted,
    EtcdError,
    Interrupted,
    LeaseNotFound,
    PermissionDenied,
    TokenInvalid,
    Unavailable,
    UsageError,
)

# "X as X": re-exported, where callers of this module have always found them.
from conch.etcd.endpoints import TLS as TLS
from conch.etcd.endpoints import Credentials as Credentials
from conch.etcd.endpoints import Endpoint as Endpoint
from conch.etcd.endpoints import Stubs, check_fork_support, loop_native
from conch.etcd.endpoints import check_timeout as check_timeout
from conch.etcd.endpoints import parse_endpoints as parse_endpoints
from conch.etcd.loop import admission, close_channel, settled
from conch.flag import Flag
from conch.timer import listen

# Seconds close() spends, in all, revoking the leases of sessions still open on the client.
CLOSE_REVOKE_TIMEOUT = 1.0
BACKOFF_FIRST = 0.05  # seconds
BACKOFF_CAP = 1.0  # seconds
ATTEMPT_FIRST = 1.0  # seconds; see Attempts.next


class Client(contextlib.AbstractContextManager["Client"]):
    """A connection to one etcd cluster through a list of endpoints.

    ``request_timeout`` (seconds) is the default deadline of each unary call, failover
    included. ``tls`` secures every endpoint (``https://`` endpoints are secured anyway);
    ``credentials`` make every call carry an etcd auth token, renewed when etcd says it is
    invalid. Use ``Client.connect`` to dial; ``close()`` (or ``with``) drops the channels:
    release every hold first (a hold still open then is lost only when its next keepalive
    fails, up to 2 TTL/3 + 1 s later, and its key stays until the lease expires).
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        request_timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        if not endpoints:
            raise UsageError("no endpoints given")
        self.endpoints = list(endpoints)
        self.request_timeout = request_timeout
        self._tls = tls
        self._credentials = credentials
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._auth_flight: asyncio.Task[str | None] | None = None  # call_async's Authenticate
        # By the event loop their grpc.aio channels are bound to (None: the blocking ones).
        self._stubs: dict[asyncio.AbstractEventLoop | None, dict[Endpoint, Stubs]] = {None: {}}
        self._current = 0
        self._lock = threading.Lock()
        self._close_hooks: dict[object, Callable[[float], None]] = {}
        self._failover_listeners: dict[object, Callable[[Endpoint], None]] = {}
        self._closed = False
        self.pid = os.getpid()  # gRPC channels do not survive fork(): a child connects its own

    @contextlib.contextmanager
    def _dialling(self, dial_timeout: float) -> Iterator[Client]:
        """``connect``'s checks (UsageError), then the client to dial, closed if that fails: an
        EtcdError but AuthenticationFailed becomes Unavailable naming the endpoints."""
        check_timeout("dial_timeout", dial_timeout)
        check_timeout("request_timeout", self.request_timeout)
        check_fork_support()
        try:
            yield self
        except BaseException as exc:
            self.close()
            if not isinstance(exc, EtcdError) or isinstance(exc, AuthenticationFailed):
                raise
            eps = ",".join(str(e) for e in self.endpoints)
            if isinstance(exc, Unavailable):
                message = f"cannot reach etcd at {eps} within {dial_timeout:g}s: {exc}"
            else:
                message = f"etcd at {eps} answered with an error: {exc}"
            raise Unavailable(message, exc.code) from None

    @classmethod
    def connect(
        cls,
        endpoints: Sequence[Endpoint],
        dial_timeout: float = 5.0,
        request_timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> Client:
        """Dial until some endpoint answers (Auth.Authenticate with credentials, else
        Maintenance.Status; nothing written); Unavailable after ``dial_timeout`` seconds, or
        AuthenticationFailed. UsageError for a timeout not above 0 or over 10 years, and in a
        process forked from one that used gRPC with its fork support off (calls would hang)."""
        with cls(endpoints, request_timeout, tls, credentials)._dialling(dial_timeout) as client:
            client._dial(dial_timeout)
        return client

    @classmethod
    async def connect_async(
        cls,
        endpoints: Sequence[Endpoint],
        dial_timeout: float = 5.0,
        request_timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> Client:
        """``connect`` for coroutines: the same dial through ``call_async``, the same
        errors. A cancel closes the client before it propagates."""
        with cls(endpoints, request_timeout, tls, credentials)._dialling(dial_timeout) as client:
            await client._dial_async(dial_timeout)
        return client

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Revoke the leases of the sessions still open on this client (CLOSE_REVOKE_TIMEOUT
        seconds in all: a waiter's key or a hold left open goes now, not after its TTL), then
        drop the channels; in a forked process only forget them (they are the parent's)."""
        if os.getpid() == self.pid:
            with self._lock:
                hooks, self._close_hooks = list(self._close_hooks.values()), {}
            deadline = time.monotonic() + CLOSE_REVOKE_TIMEOUT
            for hook in hooks:
                hook(max(0.05, deadline - time.monotonic()))
        with self._lock:
            self._closed = True
            by_loop, self._stubs = self._stubs, {None: {}}
        if os.getpid() == self.pid:
            for loop, table in by_loop.items():
                for s in table.values():
                    close_channel(loop, s.channel)

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint calls go to now."""
        return self.endpoints[self._current]

    def _stubs_for(
        self, endpoint: Endpoint, loop: asyncio.AbstractEventLoop | None = None
    ) -> Stubs:
        """The blocking stubs of ``endpoint``, or grpc.aio ones bound to ``loop`` (running);
        UsageError in a forked process, the closed client's EtcdError once closed."""
        self._check_process()
        with self._lock:
            if self._closed:
                raise _closed_error()
            stubs = self._table(loop).get(endpoint)
        if stubs is None:
            # Outside the lock: with skip_verify it is a TLS handshake (up to 5 s on a hung member).
            dialled = Stubs.dial(endpoint, self._tls, loop_native=loop is not None)
            with self._lock:
                stubs = None if self._closed else self._table(loop).setdefault(endpoint, dialled)
            if stubs is not dialled:
                close_channel(loop, dialled.channel)
            if stubs is None:
                raise _closed_error()
        return stubs

    def _check_process(self) -> None:
        if os.getpid() != self.pid:
            raise UsageError(
                f"this Client was connected in process {self.pid}, not in this one "
                f"({os.getpid()}): a forked process must connect a Client of its own"
            )

    def _table(self, loop: asyncio.AbstractEventLoop | None) -> dict[Endpoint, Stubs]:
        """The stubs dialled for ``loop`` (None: the blocking ones), under our lock; closes
        the channels of loops that have ended (nothing else would)."""
        table = self._stubs.get(loop)
        if table is None:
            for ended in [other for other in self._stubs if other and other.is_closed()]:
                for s in self._stubs.pop(ended).values():
                    close_channel(ended, s.channel)
            table = self._stubs[loop] = {}
        return table

    def failover(self, failed: Endpoint) -> None:
        """Move on from ``failed`` to the next endpoint (no-op if someone already moved on),
        telling the ``on_failover`` listeners when this call is the one that moved."""
        with self._lock:
            moved = self.endpoints[self._current] == failed
            if moved:
                self._current = (self._current + 1) % len(self.endpoints)
            listeners = tuple(self._failover_listeners.values()) if moved else ()
        for listener in listeners:
            listener(failed)

    def on_close(self, hook: Callable[[float], None]) -> Callable[[], None]:
        """Call ``hook(seconds it may take)`` from ``close()`` before the channels go (a
        session revokes its lease). Returns a function that removes it."""
        with self._lock:
            return listen(self._close_hooks, hook)

    def on_failover(self, listener: Callable[[Endpoint], None]) -> Callable[[], None]:
        """Call ``listener(failed_endpoint)`` (from the thread that failed over) each time calls
        move away from an endpoint, so streams still on it can move too. Returns its remover."""
        with self._lock:
            return listen(self._failover_listeners, listener)

    def authenticate(self, timeout: float | None = None) -> None:
        """Auth.Authenticate with our credentials within ``timeout`` seconds (default
        ``request_timeout``), the token kept for later calls. Raises AuthenticationFailed
        for a wrong user or password, Unavailable when no member answers in time."""
        if self._credentials is not None:
            self._dial(timeout)

    def _dial_call(self) -> tuple[str, str, Any]:  # called without a token: none is needed
        if self._credentials is None:
            return "maintenance", "Status", rpc_pb2.StatusRequest()
        user, password = self._credentials.user, self._credentials.password
        return "auth", "Authenticate", rpc_pb2.AuthenticateRequest(name=user, password=password)

    def _dial(self, timeout: float | None) -> str | None:
        return self._keep(self.call(*self._dial_call(), timeout, True))

    async def _dial_async(self, timeout: float | None) -> str | None:
        return self._keep(await self.call_async(*self._dial_call(), timeout, True))

    def _keep(self, response: Any) -> str | None:
        token: str | None = getattr(response, "token", None)  # a StatusResponse has none
        self._token = token
        return token

    def invalidate_token(self, stale: str | None = None) -> None:
        """Forget the token, or only ``stale`` when given (a token another thread has already
        replaced stays): the next call or stream authenticates again."""
        with self._lock:
            if stale is None or self._token == stale:
                self._token = None

    def token_at_hand(self) -> bool:
        """Whether a call or stream opened now needs no Auth.Authenticate first."""
        return self._credentials is None or self._token is not None

    def token(self, timeout: float | None = None) -> str | None:
        """The auth token calls carry now (None without credentials), from Auth.Authenticate
        within ``timeout`` seconds (default ``request_timeout``) when there is none: one
        thread authenticates, the others wait for its token (a burst of stale tokens costs
        one Authenticate). Raises AuthenticationFailed, or Unavailable when none comes in time."""
        credentials, token = self._credentials, self._token  # read once: others reset it
        if credentials is None or token is not None:
            return token
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        if not self._auth_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Unavailable("timed out waiting for another thread's Auth.Authenticate")
        try:
            return self._token or self._dial(max(0.001, deadline - time.monotonic()))
        finally:
            self._auth_lock.release()

    def call(
        self,
        service: str,
        method: str,
        request: Any,
        timeout: float | None = None,
        _authenticating: bool = False,
        interrupt: Flag | None = None,
    ) -> Any:
        """One unary RPC, e.g. ``call("kv", "Range", RangeRequest(...))``, failing over on
        UNAVAILABLE and authenticating again on a stale token, retried until ``timeout``
        seconds (default ``request_timeout``) pass; ``interrupt``, once set, ends the retries
        (not an attempt in flight) with Interrupted. Raises Unavailable, PermissionDenied,
        AuthenticationFailed, LeaseNotFound, Compacted, Interrupted or EtcdError."""
        attempts = Attempts(self, timeout)
        while True:
            endpoint, attempt = attempts.next()
            token = None
            try:
                stub = getattr(self._stubs_for(endpoint), service)
                token = None if _authenticating else self.token(max(0.001, attempts.left()))
                return getattr(stub, method)(request, timeout=attempt, metadata=_metadata(token))
            except (grpc.RpcError, Unavailable, ValueError) as exc:
                error = self._attempt_error(exc, endpoint)
            pause = attempts.failed(error, endpoint, token)
            if interrupt is None:
                time.sleep(pause)
            elif interrupt.wait(pause):
                raise Interrupted(interrupt.reason)

    def _attempt_error(self, exc: Exception, endpoint: Endpoint) -> EtcdError:
        """An attempt's exception: gRPC's mapped, our Unavailable (no token in time) as it
        is; a ValueError "Cannot invoke RPC on closed channel!" (grpc.aio: UsageError) raised
        as the closed client's error, any other raised as it is."""
        if isinstance(exc, grpc.RpcError):
            return map_rpc_error(exc, endpoint)
        if isinstance(exc, Unavailable):
            return exc
        if self._closed:
            raise _closed_error() from None
        raise exc

    async def call_async(
        self,
        service: str,
        method: str,
        request: Any,
        timeout: float | None = None,
        _authenticating: bool = False,
        interrupt: asyncio.Event | None = None,
    ) -> Any:
        """``call`` for coroutines (``Attempts`` decides for both), each attempt a grpc.aio
        call on a channel of the running loop (forked while grpc.aio channels were open: a
        blocking call's ``.future()`` that wakes the loop); ``interrupt`` as ``call``'s Flag.
        Cancelling cancels the attempt in flight (a write may have applied, as after a
        timeout). Raises as ``call``."""
        self._check_process()  # before the loop: in a forked child there may be none
        loop = asyncio.get_running_loop()
        native = loop_native()
        attempts = Attempts(self, timeout)
        stop = asyncio.Event() if interrupt is None else interrupt  # never set without one
        while True:
            endpoint, attempt = attempts.next()
            token = None
            try:
                stub = getattr(self._stubs_for(endpoint, loop if native else None), service)
                if not _authenticating:
                    token = await self.token_async(max(0.001, attempts.left()))
                rpc = getattr(stub, method) if native else getattr(stub, method).future
                async with admission(loop):  # the time it waits is the attempt's
                    attempt = min(attempt, max(attempts.left(), 0.001))
                    answer = rpc(request, timeout=attempt, metadata=_metadata(token))
                    return await (answer if native else settled(answer))
            except (grpc.RpcError, Unavailable, ValueError, grpc.aio.UsageError) as exc:
                error = self._attempt_error(exc, endpoint)
            pause = attempts.failed(error, endpoint, token)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            if stop.is_set():
                raise Interrupted("interrupted")

    async def token_async(self, timeout: float | None = None) -> str | None:
        """``token`` for coroutines, through ``call_async``: the coroutines of one loop that
        find no token await one Auth.Authenticate. Raises as ``token``."""
        credentials, token = self._credentials, self._token  # read once: others reset it
        if credentials is None or token is not None:
            return token
        loop = asyncio.get_running_loop()
        flight = self._auth_flight
        if flight is None or flight.done() or flight.get_loop() is not loop:
            flight = self._auth_flight = loop.create_task(self._dial_async(timeout))
        # Shielded: one caller's cancel must not end the Authenticate the others await.
        return await asyncio.shield(flight)

    def open_stream(
        self,
        service: str,
        method: str,
        requests: Iterator[Any] | AsyncIterator[Any],
        timeout: float | None = None,
        token: str | None = None,
        endpoint: Endpoint | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> tuple[Endpoint, Any]:
        """Open a bidirectional stream on ``endpoint`` (default: the current one) with ``token``
        (default ``token(timeout)``; with ``loop``, a grpc.aio stream on that running loop, the
        caller's token); the caller owns failover and, when it ends with TokenInvalid,
        ``invalidate_token(token)``. ``hasleader``: etcd ends it if its member loses the leader."""
        if loop is None:
            token = token or self.token(timeout)
        metadata = (*_metadata(token), ("hasleader", "true"))
        endpoint = self.endpoint if endpoint is None else endpoint
        stub = getattr(self._stubs_for(endpoint, loop), service)
        try:  # the call: the handle to cancel and the iterator of responses
            return endpoint, getattr(stub, method)(requests, metadata=metadata)
        except (ValueError, grpc.aio.UsageError) as exc:
            raise self._attempt_error(exc, endpoint) from None


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("token", token),)


def _closed_error() -> EtcdError:  # a call's or a stream's on a closed Client
    return EtcdError("client is closed", "CANCELLED")


def connect(
    endpoints: str | Sequence[str],
    dial_timeout: float = 5.0,
    request_timeout: float = 5.0,
    tls: TLS | None = None,
    credentials: Credentials | None = None,
) -> Client:
    """A Client for ``endpoints`` (a comma-separated string or a list of ``host:port`` /
    ``http(s)://host:port``), dialled within ``dial_timeout`` seconds. Raises Unavailable
    when none answers in time, AuthenticationFailed for wrong credentials, UsageError for a
    bad endpoint or a timeout not above 0 or over 10 years (gRPC would wait forever)."""
    parsed = parse_endpoints(endpoints)
    return Client.connect(parsed, dial_timeout, request_timeout, tls, credentials)


def map_rpc_error(error: grpc.RpcError, endpoint: Endpoint | None = None) -> EtcdError:
    """Turn a gRPC error from etcd into the conch exception that says what happened."""
    # A grpc.aio call's error (AioRpcError) is no grpc.Call, but has its code() and details().
    status = isinstance(error, grpc.Call | grpc.aio.AioRpcError)
    code = error.code() if status else grpc.StatusCode.UNKNOWN
    details = (error.details() if status else None) or str(error)
    message = f"{details} ({endpoint})" if endpoint else details
    # etcd's UNKNOWN "context deadline exceeded" (out of time inside the server) is as
    # retryable as our timeout; gRPC's "Stream removed" (an RST_STREAM from a busy server: etcd
    # 3.4, a LeaseRevoke in a burst of auth changes) as a broken connection (every conch call
    # is safe to repeat).
    retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    timed_out = ("context deadline exceeded", "request timed out", "Stream removed")
    if code in retryable or any(words in details for words in timed_out):
        return Unavailable(message, code.name)
    # Permissions changed since the token was issued (etcd's apply path's words, or 3.4's
    # gRPC error's): authenticate again.
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
    """Capped exponential backoff with decorrelated jitter (else the waiters of one outage
    retry in lockstep, each retry a burst on etcd): ``next()`` gives the next pause in
    seconds, from [``first``, 3 x the previous one] (the first from [``first``, 3 x
    ``first``]), never over ``cap``. ``rng`` (a ``random.Random``) makes it reproducible;
    ``reset()`` starts again from ``first`` (after progress)."""

    def __init__(
        self,
        first: float = BACKOFF_FIRST,
        cap: float = BACKOFF_CAP,
        rng: random.Random | None = None,
    ) -> None:
        self._first = self._last = first
        self._cap = cap
        # Else the random module's one generator: seeding one (os.urandom) costs tens of
        # microseconds, and a Hold makes its Backoff on the handoff's path.
        self._uniform = (rng or random).uniform

    def next(self) -> float:
        self._last = min(self._cap, self._uniform(self._first, self._last * 3))
        return self._last

    def reset(self) -> None:
        self._last = self._first


class Attempts:
    """The decisions of one unary call (``call`` or ``call_async``) across its attempts,
    within ``timeout`` seconds (default the client's ``request_timeout``)."""

    def __init__(self, client: Client, timeout: float | None) -> None:
        if timeout is not None:
            check_timeout("timeout", timeout)  # nan or inf would make gRPC wait forever
        self._client = client
        self.deadline = time.monotonic() + (client.request_timeout if timeout is None else timeout)
        self._backoff = Backoff()
        self._tried_in_round = self._stale_tokens = self._rounds = 0

    def left(self) -> float:
        """Seconds left until the call's deadline (negative once past)."""
        return self.deadline - time.monotonic()

    def next(self) -> tuple[Endpoint, float]:
        """The endpoint of the next attempt, and the seconds it may take there: with other
        endpoints to try, ATTEMPT_FIRST doubled each full round over them (a silent member
        holds an attempt this long; half the time left held a LeaseRevoke 2.5 s on a cut-off
        leader), so that a link that is only slow still gets calls through."""
        left = self.left()
        if len(self._client.endpoints) > 1:
            left = min(left, ATTEMPT_FIRST * 2.0 ** min(self._rounds, 6))
        return self._client.endpoint, max(left, 0.001)

    def failed(self, error: EtcdError, endpoint: Endpoint, token: str | None) -> float:
        """The seconds to pause (0: none) after an attempt on ``endpoint`` with ``token``
        failed with ``error``; raises it when not worth retrying or out of time (Unavailable
        when a fresh token never came)."""
        stale = isinstance(error, TokenInvalid) and token is not None
        if not (stale or isinstance(error, Unavailable)) or time.monotonic() >= self.deadline:
            if stale:
                # Out of time renewing tokens: as transient as a member that is away.
                raise Unavailable(f"no fresh auth token accepted in time: {error}") from None
            raise error
        if stale:
            # A burst of auth changes (each makes older JWT tokens stale) outruns any fixed
            # count of retries: retry while time is left, at once the first time.
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
