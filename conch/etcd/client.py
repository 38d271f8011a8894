"""The connection to an etcd cluster: endpoints, deadlines, failover, and error mapping.

Every unary call carries a deadline. A call that fails with UNAVAILABLE (connection refused,
member stopped, no leader) or runs out its per-attempt time moves to the next endpoint and is
tried again, with capped exponential backoff between rounds, until the call's own deadline.
Streams (watch, keepalive) run on the current endpoint; their owners re-open them after a
failure, which lands them on the next endpoint.

With credentials, calls and streams carry an auth token. etcd refuses a stale one: expired,
issued before an auth change (a JWT token carries the auth revision it was issued at), or
unknown to a member that restarted (simple tokens live in each member's memory). One thread
then authenticates for all (``Client.token``), and the call is retried with the fresh
token within its own deadline.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
from conchpb.etcdserverpb import rpc_pb2, rpc_pb2_grpc

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
from conch.flag import Flag

if TYPE_CHECKING:
    import asyncio  # imported where used: the command never needs it

MAX_TIMEOUT = 10 * 365 * 86400.0  # seconds; gRPC's deadlines overflow somewhere past 1e9 s

# HTTP/2 pings find a dead connection even on an idle stream. etcd refuses pings more often
# than every 5 s (--grpc-keepalive-min-time), so stay above that.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),  # etcd answers pings on idle links with GOAWAY
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # gRPC's reconnect backoff grows to 2 minutes: a client that lived through a long outage
    # stayed unavailable for 14-20 s after etcd was back. Dialling a member is cheap.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
BACKOFF_FIRST = 0.05  # seconds
# Seconds close() spends, in all, revoking the leases of sessions still open on the client.
CLOSE_REVOKE_TIMEOUT = 1.0
BACKOFF_CAP = 1.0  # seconds
ATTEMPT_FIRST = 1.0  # seconds; see _attempt_time


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client URL, parsed: ``host:port`` or ``http(s)://host:port``."""

    host: str
    port: int
    tls: bool

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return ("https://" if self.tls else "") + self.target

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse one endpoint; raise UsageError naming it when it is not ``[scheme://]host:port``."""
        raw = text.strip()
        tls = False
        for scheme, is_tls in (("http://", False), ("https://", True)):
            if raw.startswith(scheme):
                raw, tls = raw[len(scheme) :], is_tls
        raw = raw.rstrip("/")
        host, sep, port = raw.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        bad_host = not host or any(c in host for c in "[]/ ") or not host.isprintable()
        if not sep or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"bad endpoint {text!r}: want host:port or http(s)://host:port")
        return cls(host, int(port), tls)


@dataclass(frozen=True)
class TLS:
    """Transport security: PEM bytes of the CA bundle (None: the system's roots), and of the
    client certificate and key for mutual TLS. ``skip_verify`` trusts whatever certificate
    each endpoint presents (etcdctl's --insecure-skip-tls-verify): encrypted, but open to a
    man in the middle."""

    cacert: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    skip_verify: bool = False

    def channel(self, endpoint: Endpoint) -> grpc.Channel:
        """A secure channel to ``endpoint``. Raises Unavailable when skip_verify cannot fetch
        the endpoint's certificate."""
        roots = self.cacert
        options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
        if self.skip_verify:
            # gRPC cannot turn verification off; trust the presented certificate itself,
            # under a name it carries.
            roots, name = _presented_certificate(endpoint, self.cert, self.key)
            options.append(("grpc.ssl_target_name_override", name))
        creds = grpc.ssl_channel_credentials(roots, self.key, self.cert)
        return grpc.secure_channel(endpoint.target, creds, options=options)


def _presented_certificate(
    endpoint: Endpoint, cert: bytes | None, key: bytes | None, timeout: float = 5.0
) -> tuple[bytes, str]:
    """The PEM certificate ``endpoint`` presents, and a host name it is valid for. One TLS
    handshake without verification, showing our client certificate (``cert``, ``key``: PEM)
    if we have one, since an etcd that requires one ends the handshake without it."""
    import os
    import socket
    import ssl
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with tempfile.TemporaryDirectory() as tmp:

        def write(name: str, data: bytes) -> str:
            path = os.path.join(tmp, name)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(data)
            return path

        try:
            if cert is not None and key is not None:
                context.load_cert_chain(write("cert.pem", cert), write("key.pem", key))
            address = (endpoint.host, endpoint.port)
            with (
                socket.create_connection(address, timeout=timeout) as sock,
                context.wrap_socket(sock, server_hostname=endpoint.host) as tls,
            ):
                der = tls.getpeercert(binary_form=True)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"cannot fetch the TLS certificate of {endpoint}: {exc}") from None
        if der is None:
            raise Unavailable(f"{endpoint} presented no TLS certificate")
        pem = ssl.DER_cert_to_PEM_cert(der)
        try:
            decoded = ssl._ssl._test_decode_cert(write("server.pem", pem.encode()))  # type: ignore[attr-defined]
        except (ssl.SSLError, AttributeError):
            decoded = {}
    name = endpoint.host
    names = [value for kind, value in decoded.get("subjectAltName", ()) if kind == "DNS"]
    names += [value for kind, value in decoded.get("subjectAltName", ()) if kind == "IP Address"]
    if names and name not in names:
        name = names[0]
    return pem.encode(), name


@dataclass(frozen=True)
class Credentials:
    """An etcd user and its password (never logged, never shown)."""

    user: str
    password: str = field(repr=False)


class _Stubs(NamedTuple):
    endpoint: Endpoint
    channel: grpc.Channel
    kv: rpc_pb2_grpc.KVStub
    lease: rpc_pb2_grpc.LeaseStub
    watch: rpc_pb2_grpc.WatchStub
    maintenance: rpc_pb2_grpc.MaintenanceStub
    auth: rpc_pb2_grpc.AuthStub

    @classmethod
    def dial(cls, endpoint: Endpoint, tls: TLS | None) -> _Stubs:
        global _dialled_in
        _dialled_in = os.getpid()
        if endpoint.tls or tls is not None:
            channel = (tls or TLS()).channel(endpoint)
        else:
            channel = grpc.insecure_channel(endpoint.target, options=_CHANNEL_OPTIONS)
        return cls(
            endpoint,
            channel,
            rpc_pb2_grpc.KVStub(channel),
            rpc_pb2_grpc.LeaseStub(channel),
            rpc_pb2_grpc.WatchStub(channel),
            rpc_pb2_grpc.MaintenanceStub(channel),
            rpc_pb2_grpc.AuthStub(channel),
        )


def map_rpc_error(error: grpc.RpcError, endpoint: Endpoint | None = None) -> EtcdError:
    """Turn a gRPC error from etcd into the conch exception that says what happened."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
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


# The process that last dialled a channel: a child forked from it inherits gRPC's state.
_dialled_in: int | None = None
_FALSE = ("0", "false", "no", "n", "f", "off")


def _check_fork_support() -> None:
    """Raise UsageError in a process forked from one that used gRPC when gRPC's fork support
    is off (GRPC_ENABLE_FORK_SUPPORT=false): its first call would hang in gRPC for good,
    past every deadline (found with multiprocessing's fork start method)."""
    setting = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").strip().lower()
    if _dialled_in not in (None, os.getpid()) and setting in _FALSE:
        raise UsageError(
            f"gRPC was used in process {_dialled_in} before it forked this one, and "
            f"GRPC_ENABLE_FORK_SUPPORT={setting}: a forked process cannot use gRPC then; "
            "leave GRPC_ENABLE_FORK_SUPPORT unset (or true) in the parent"
        )


_JITTER = random.Random()


class Backoff:
    """Capped exponential backoff with decorrelated jitter: ``next()`` gives the next pause
    in seconds, drawn from [``first``, 3 x the previous pause] (the first from [``first``,
    3 x ``first``]), never over ``cap``.

    Without jitter every waiter on every machine that saw one outage would retry in
    lockstep after it (the pauses of all of them the same sequence), each retry a burst
    on etcd. ``rng`` (a ``random.Random``) makes the sequence reproducible; ``reset()``
    starts again from ``first`` (after progress)."""

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


class Client:
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
        self._auth_flight: asyncio.Task[str] | None = None  # call_async's Authenticate
        self._stubs: dict[Endpoint, _Stubs] = {}
        self._current = 0
        self._lock = threading.Lock()
        self._close_hooks: list[Callable[[float], None]] = []
        self._failover_listeners: list[Callable[[Endpoint], None]] = []
        self._closed = False
        # gRPC channels do not survive fork(): a forked child must connect its own Client.
        self.pid = os.getpid()

    @classmethod
    def _to_dial(
        cls,
        endpoints: Sequence[Endpoint],
        dial_timeout: float,
        request_timeout: float,
        tls: TLS | None,
        credentials: Credentials | None,
    ) -> Client:
        """The checks of ``connect`` and ``connect_async`` (UsageError), then the client
        they dial with."""
        check_timeout("dial_timeout", dial_timeout)
        check_timeout("request_timeout", request_timeout)
        _check_fork_support()
        return cls(endpoints, request_timeout, tls, credentials)

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
        Maintenance.Status); raise Unavailable after ``dial_timeout`` seconds, or
        AuthenticationFailed. Writes nothing to etcd. Raises UsageError for a timeout that is
        not above 0 or is over 10 years, and in a process forked from one that used gRPC with
        its fork support off (its calls would hang)."""
        client = cls._to_dial(endpoints, dial_timeout, request_timeout, tls, credentials)
        try:
            if credentials is not None:
                client.authenticate(timeout=dial_timeout)
            else:
                client.call("maintenance", "Status", rpc_pb2.StatusRequest(), dial_timeout)
        except AuthenticationFailed:
            client.close()
            raise
        except EtcdError as exc:
            client.close()
            raise dial_failed(exc, endpoints, dial_timeout) from None
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
        """``connect`` for coroutines: the same dial (Auth.Authenticate with credentials,
        else Maintenance.Status) through ``call_async``, the same errors. A cancel closes
        the client before it propagates."""
        client = cls._to_dial(endpoints, dial_timeout, request_timeout, tls, credentials)
        try:
            if credentials is not None:
                await client._authenticate_async(credentials, dial_timeout)
            else:
                request = rpc_pb2.StatusRequest()
                await client.call_async("maintenance", "Status", request, dial_timeout)
        except AuthenticationFailed:
            client.close()
            raise
        except EtcdError as exc:
            client.close()
            raise dial_failed(exc, endpoints, dial_timeout) from None
        except BaseException:
            client.close()
            raise
        return client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Revoke the leases of the sessions still open on this client (at most
        CLOSE_REVOKE_TIMEOUT seconds in all: a waiter's key or a hold left open goes at once,
        not after its TTL), then drop the channels. In a process forked from the one that
        connected, only forget them: they belong to the parent."""
        if os.getpid() == self.pid:
            with self._lock:
                hooks, self._close_hooks = list(self._close_hooks), []
            deadline = time.monotonic() + CLOSE_REVOKE_TIMEOUT
            for hook in hooks:
                hook(max(0.05, deadline - time.monotonic()))
        with self._lock:
            self._closed = True
            stubs, self._stubs = list(self._stubs.values()), {}
        if os.getpid() != self.pid:
            return
        for s in stubs:
            s.channel.close()

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint calls go to now."""
        return self.endpoints[self._current]

    def _stubs_for(self, endpoint: Endpoint) -> _Stubs:
        if os.getpid() != self.pid:
            raise UsageError(
                f"this Client was connected in process {self.pid}, not in this one "
                f"({os.getpid()}): a forked process must connect a Client of its own"
            )
        with self._lock:
            if self._closed:
                raise _closed_error()
            stubs = self._stubs.get(endpoint)
        if stubs is not None:
            return stubs
        # Dialled outside the lock: with --insecure-skip-tls-verify it is a TLS handshake
        # (up to 5 s against a hung member) that other calls must not wait behind.
        dialled = _Stubs.dial(endpoint, self._tls)
        with self._lock:
            closed = self._closed
            stubs = None if closed else self._stubs.setdefault(endpoint, dialled)
        if stubs is not dialled:
            dialled.channel.close()
        if stubs is None:
            raise _closed_error()
        return stubs

    def failover(self, failed: Endpoint) -> None:
        """Move on from ``failed`` to the next endpoint (no-op if someone already moved on).
        Listeners (``on_failover``) hear of it when this call is the one that moved."""
        with self._lock:
            moved = self.endpoints[self._current] == failed
            if moved:
                self._current = (self._current + 1) % len(self.endpoints)
            listeners = tuple(self._failover_listeners) if moved else ()
        for listener in listeners:
            listener(failed)

    def on_close(self, hook: Callable[[float], None]) -> Callable[[], None]:
        """Call ``hook(seconds)`` from ``close()`` before the channels go, with the time it
        may take (a session revokes its lease). Returns a function that removes it."""
        return self._add(self._close_hooks, hook)

    def on_failover(self, listener: Callable[[Endpoint], None]) -> Callable[[], None]:
        """Call ``listener(failed_endpoint)`` (from the thread that failed over) each time
        calls move away from an endpoint, so that streams still on it can move too. Returns
        a function that removes it."""
        return self._add(self._failover_listeners, listener)

    def _add(self, callbacks: list[Any], callback: Any) -> Callable[[], None]:
        """Append ``callback`` to one of our lists, under our lock; return its remover."""
        with self._lock:
            callbacks.append(callback)

        def remove() -> None:
            with self._lock, contextlib.suppress(ValueError):
                callbacks.remove(callback)

        return remove

    def authenticate(self, timeout: float | None = None) -> None:
        """Auth.Authenticate with our credentials and keep the token for later calls, within
        ``timeout`` seconds (default ``request_timeout``). Raises AuthenticationFailed for a
        wrong user or password, Unavailable when no member answers in time."""
        if self._credentials is None:
            return
        self._authenticate(self._credentials, timeout)

    def _authenticate(self, credentials: Credentials, timeout: float | None) -> str:
        request = rpc_pb2.AuthenticateRequest(name=credentials.user, password=credentials.password)
        response = self.call("auth", "Authenticate", request, timeout, _authenticating=True)
        token: str = response.token
        self._token = token
        return token

    def invalidate_token(self, stale: str | None = None) -> None:
        """Forget the token, or only the token ``stale`` when given (a caller that failed
        with a token another thread has already replaced keeps the replacement): the next
        call or stream authenticates again."""
        with self._lock:
            if stale is None or self._token == stale:
                self._token = None

    def token_at_hand(self) -> bool:
        """Whether a call or stream opened now needs no Auth.Authenticate first."""
        return self._credentials is None or self._token is not None

    def token(self, timeout: float | None = None) -> str | None:
        """The auth token calls carry now (None without credentials), from Auth.Authenticate
        within ``timeout`` seconds (default ``request_timeout``) when there is none.

        Single-flight: when the token was invalidated, one thread authenticates and the others
        wait for its token, so a burst of stale tokens costs one Authenticate, not one per
        thread. Raises AuthenticationFailed, or Unavailable when no token comes in time."""
        credentials, token = self._credentials, self._token  # read once: others reset it
        if credentials is None or token is not None:
            return token
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        if not self._auth_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Unavailable("timed out waiting for another thread's Auth.Authenticate")
        try:
            token = self._token
            if token is None:
                token = self._authenticate(credentials, max(0.001, deadline - time.monotonic()))
            return token
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
        """One unary RPC, e.g. ``call("kv", "Range", RangeRequest(...))``.

        Fails over and retries on UNAVAILABLE, and authenticates again and retries when the
        token is stale (expired, issued before an auth change, unknown to a member that
        restarted), until ``timeout`` seconds (default ``request_timeout``) pass. ``interrupt``,
        when set, ends the retries (not an attempt in flight) with Interrupted. Raises
        Unavailable, PermissionDenied, AuthenticationFailed, LeaseNotFound, Compacted,
        Interrupted or EtcdError.
        """
        attempts = _Attempts(self, timeout)
        while True:
            endpoint, attempt = attempts.next()
            error: EtcdError
            token = None
            try:
                stub = getattr(self._stubs_for(endpoint), service)
                token = None if _authenticating else self.token(max(0.001, attempts.left()))
                return getattr(stub, method)(request, timeout=attempt, metadata=_metadata(token))
            except (grpc.RpcError, Unavailable, ValueError) as exc:
                error = self._attempt_error(exc, endpoint)
            pause = attempts.failed(error, endpoint, token)
            if pause <= 0:
                continue
            if interrupt is None:
                time.sleep(pause)
            elif interrupt.wait(pause):
                raise Interrupted(interrupt.reason)

    def _attempt_error(self, exc: Exception, endpoint: Endpoint) -> EtcdError:
        """What an attempt's exception on ``endpoint`` means: gRPC's error mapped, our own
        Unavailable (no token in time) as it is; gRPC's ValueError "Cannot invoke RPC on
        closed channel!" raised as the closed client's error (any other raised as it is)."""
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
        """``call`` for coroutines: the same RPC, deadlines, failover, backoff and token
        renewal (``_Attempts`` makes every decision for both), each attempt a gRPC
        ``.future()`` whose end is handed to the running loop, so no thread waits for it.
        ``interrupt``, when set, ends the retries (not an attempt in flight) with
        Interrupted, as ``call``'s Flag does. Cancelling the awaiting task cancels the
        attempt in flight (a write may then have been applied, as after a timeout). Raises
        as ``call``."""
        import asyncio

        attempts = _Attempts(self, timeout)
        while True:
            endpoint, attempt = attempts.next()
            error: EtcdError
            token = None
            try:
                stub = getattr(self._stubs_for(endpoint), service)
                if not _authenticating:
                    token = await self.token_async(max(0.001, attempts.left()))
                call = getattr(stub, method).future(
                    request, timeout=attempt, metadata=_metadata(token)
                )
                return await _settled(call)
            except (grpc.RpcError, Unavailable, ValueError) as exc:
                error = self._attempt_error(exc, endpoint)
            pause = attempts.failed(error, endpoint, token)
            if interrupt is None:
                if pause > 0:
                    await asyncio.sleep(pause)
                continue
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11 on
                await asyncio.wait_for(interrupt.wait(), pause)
            if interrupt.is_set():
                raise Interrupted("interrupted")

    async def token_async(self, timeout: float | None = None) -> str | None:
        """``token`` for coroutines: the auth token calls carry now (None without
        credentials), from Auth.Authenticate (``call_async``) within ``timeout`` seconds
        (default ``request_timeout``) when there is none. Single-flight per event loop: the
        coroutines that find no token await one Authenticate. Raises as ``token``."""
        import asyncio

        credentials, token = self._credentials, self._token  # read once: others reset it
        if credentials is None or token is not None:
            return token
        loop = asyncio.get_running_loop()
        flight = self._auth_flight
        if flight is None or flight.done() or flight.get_loop() is not loop:
            flight = self._auth_flight = loop.create_task(
                self._authenticate_async(credentials, timeout)
            )
        # Shielded: one caller's cancel must not end the Authenticate the others await.
        return await asyncio.shield(flight)

    async def _authenticate_async(self, credentials: Credentials, timeout: float | None) -> str:
        request = rpc_pb2.AuthenticateRequest(name=credentials.user, password=credentials.password)
        response = await self.call_async("auth", "Authenticate", request, timeout, True)
        token: str = response.token
        self._token = token
        return token

    def open_stream(
        self,
        service: str,
        method: str,
        requests: Iterator[Any],
        timeout: float | None = None,
        token: str | None = None,
        endpoint: Endpoint | None = None,
    ) -> tuple[Endpoint, Any]:
        """Open a bidirectional stream on ``endpoint`` (default: the current one) with
        ``token`` (by default ``token(timeout)``); the caller owns failover and, when the
        stream ends with TokenInvalid, ``invalidate_token(token)``. Streams ask for
        ``hasleader``: etcd then ends them when the member loses its leader (partitioned from
        the quorum), instead of leaving them silent."""
        token = token or self.token(timeout)
        metadata = (*((("token", token),) if token else ()), ("hasleader", "true"))
        endpoint = self.endpoint if endpoint is None else endpoint
        stub = getattr(self._stubs_for(endpoint), service)
        try:
            # The call is both the handle to cancel and the iterator of responses.
            return endpoint, getattr(stub, method)(requests, metadata=metadata)
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise _closed_error() from None
            raise


def _attempt_time(rounds: int) -> float:
    """Seconds one attempt of a unary call may take on one member, with other endpoints to
    try, after ``rounds`` full rounds over the endpoints failed. A silent member (cut off, or
    a leader cut from us) holds each call this long before another member is asked, so it
    starts short; it doubles each round, so a link that is only slow still gets calls
    through. (An attempt of half the time left held a LeaseRevoke 2.5 s on an unreachable
    leader, and the next holder waited as long.)"""
    return ATTEMPT_FIRST * 2.0 ** min(rounds, 6)


class _Attempts:
    """The decisions of one unary call across its attempts, the same for ``Client.call``
    and ``Client.call_async``: the endpoint and time of each attempt, which errors fail over
    (UNAVAILABLE, a timeout) and which mean a stale token, when to give up, and the pause
    before the next attempt (capped exponential backoff between rounds over the endpoints).
    ``timeout`` (seconds, default the client's ``request_timeout``) bounds the whole call."""

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
        """The endpoint of the next attempt, and the seconds it may take there."""
        endpoint = self._client.endpoint
        left = self.left()
        many = len(self._client.endpoints) > 1
        attempt = min(left, _attempt_time(self._rounds)) if many else left
        return endpoint, max(attempt, 0.001)

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


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("token", token),)


async def _settled(call: grpc.Future[Any]) -> Any:
    """Await a gRPC ``.future()`` call on the running loop: its done-callback (on gRPC's
    thread) wakes the loop with ``call_soon_threadsafe``. Returns its response or raises
    its grpc.RpcError; a cancel of the awaiting task cancels the call."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_call: grpc.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(_set_done, done)

    call.add_done_callback(wake)
    try:
        await done
    except asyncio.CancelledError:
        call.cancel()
        raise
    return call.result()


def _set_done(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _closed_error() -> EtcdError:
    """What a call or stream on a closed Client raises."""
    return EtcdError("client is closed", "CANCELLED")


def dial_failed(
    error: EtcdError, endpoints: Sequence[Endpoint], dial_timeout: float
) -> Unavailable:
    """What a dial that failed with ``error`` (not AuthenticationFailed) raises: Unavailable,
    naming the endpoints."""
    eps = ",".join(str(e) for e in endpoints)
    if isinstance(error, Unavailable):
        return Unavailable(
            f"cannot reach etcd at {eps} within {dial_timeout:g}s: {error}", error.code
        )
    return Unavailable(f"etcd at {eps} answered with an error: {error}", error.code)


def check_timeout(parameter: str, seconds: float, zero: bool = False) -> None:
    """Raise UsageError naming ``parameter`` unless ``seconds`` is a number above 0 (or 0
    itself, with ``zero``) and at most 10 years (gRPC would wait forever past that)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(f"bad {parameter} {seconds!r}: want seconds, a number")
    lowest_ok = seconds >= 0 if zero else seconds > 0
    if not (math.isfinite(seconds) and lowest_ok and seconds <= MAX_TIMEOUT):
        above = "0 or more" if zero else "above 0"
        raise UsageError(f"bad {parameter} {seconds!r}: want seconds {above}, at most 10 years")


def connect(
    endpoints: str | Sequence[str],
    dial_timeout: float = 5.0,
    request_timeout: float = 5.0,
    tls: TLS | None = None,
    credentials: Credentials | None = None,
) -> Client:
    """A Client for ``endpoints`` (a comma-separated string or a list of ``host:port`` /
    ``http(s)://host:port``), dialled within ``dial_timeout`` seconds. Raises UsageError for
    a bad endpoint, Unavailable when none answers in time, AuthenticationFailed for wrong
    credentials, and for a timeout that is not above 0 or is over 10 years (gRPC would wait
    forever)."""
    check_timeout("dial_timeout", dial_timeout)
    check_timeout("request_timeout", request_timeout)
    return Client.connect(
        parse_endpoints(endpoints), dial_timeout, request_timeout, tls, credentials
    )


def parse_endpoints(endpoints: str | Sequence[str]) -> list[Endpoint]:
    """``endpoints`` (a comma-separated string or a list) parsed; UsageError naming a bad
    one, or when none is given."""
    texts = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [Endpoint.parse(t) for t in texts if t.strip()]
    if not parsed:
        raise UsageError(f"bad endpoints {endpoints!r}: no endpoint given")
    return parsed


class BidiStream:
    """A bidirectional gRPC stream whose answers arrive in a mailbox.

    ``send()`` queues a request. A reader thread puts ``StreamItem``s into ``deliver``: one per
    response, then one with ``error`` set when the stream ends for any reason; when that is
    TokenInvalid, the token it was opened with is invalidated, so that the owner's next
    stream carries a fresh one. ``timeout`` (seconds) bounds the Auth.Authenticate that
    opening may need. ``close()`` cancels the call; nothing is delivered after it. It runs on
    ``endpoint``, by default the client's current one.
    """

    def __init__(
        self,
        client: Client,
        service: str,
        method: str,
        deliver: Callable[[StreamItem], None],
        timeout: float | None = None,
        endpoint: Endpoint | None = None,
    ) -> None:
        import queue

        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._client = client
        self._deliver = deliver
        self._closed = False
        self.token = client.token(timeout)
        self.endpoint, self._call = client.open_stream(
            service,
            method,
            iter(self._requests.get, None),
            token=self.token,
            endpoint=endpoint,
        )
        self._reader = threading.Thread(
            target=self._read, args=(self._call,), name=f"conch-{method}", daemon=True
        )
        self._reader.start()

    def send(self, request: Any) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._closed = True
        self._requests.put(None)
        self._call.cancel()

    def _read(self, responses: Iterator[Any]) -> None:
        error: EtcdError
        try:
            for response in responses:
                if self._closed:
                    return
                self._deliver(StreamItem(self, response, None))
            error = Unavailable(f"stream closed by server ({self.endpoint})")
        except grpc.RpcError as rpc_error:
            error = map_rpc_error(rpc_error, self.endpoint)
        if isinstance(error, TokenInvalid):
            self._client.invalidate_token(self.token)
        if not self._closed:
            self._deliver(StreamItem(self, None, error))


class StreamItem(NamedTuple):
    """One thing a BidiStream delivers: a response, or (last) the error that ended it."""

    stream: BidiStream
    response: Any
    error: EtcdError | None
