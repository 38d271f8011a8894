"""Where calls go: etcd members' endpoints, TLS, credentials, and the gRPC channels to them:
one for blocking calls (``grpc``) and one per event loop for its coroutines (``grpc.aio``)
per member, all with HTTP/2 pings, no gRPC retries and a short reconnect backoff."""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import grpc.aio
from conchpb.etcdserverpb import rpc_pb2_grpc as pb

from conch.errors import Unavailable, UsageError

MAX_TIMEOUT = 10 * 365 * 86400.0  # seconds; gRPC's deadlines overflow somewhere past 1e9 s

# HTTP/2 pings find a dead connection even on an idle stream. etcd refuses pings more often
# than every 5 s (--grpc-keepalive-min-time), so stay above that.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),  # etcd answers pings on idle links with GOAWAY
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # gRPC's own grows to 2 minutes: a client stayed away 14-20 s after a long outage ended.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


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
        """Parse one endpoint; UsageError naming it when it is not ``[scheme://]host:port``."""
        raw = text.strip()
        tls = raw.startswith("https://")
        raw = raw.removeprefix("https://" if tls else "http://").rstrip("/")
        host, sep, port = raw.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        bad_host = not host or any(c in host for c in "[]/ ") or not host.isprintable()
        if not sep or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"bad endpoint {text!r}: want host:port or http(s)://host:port")
        return cls(host, int(port), tls)


@dataclass(frozen=True)
class TLS:
    """Transport security: PEM bytes of the CA bundle (None: the system's roots), and of the
    client certificate and key for mutual TLS. ``skip_verify`` trusts the certificate each
    endpoint presents (etcdctl's --insecure-skip-tls-verify): open to a man in the middle."""

    cacert: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    skip_verify: bool = False

    def credentials(
        self, endpoint: Endpoint
    ) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
        """The credentials and options of a secure channel to ``endpoint``. Raises
        Unavailable when skip_verify cannot fetch the endpoint's certificate."""
        roots = self.cacert
        options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
        if self.skip_verify:  # gRPC cannot skip verifying: trust the one presented, by its name
            roots, name = _presented_certificate(endpoint, self)
            options.append(("grpc.ssl_target_name_override", name))
        return grpc.ssl_channel_credentials(roots, self.key, self.cert), options


def _presented_certificate(endpoint: Endpoint, tls: TLS) -> tuple[bytes, str]:
    """The PEM certificate ``endpoint`` presents, and a host name it is valid for, from one
    unverified TLS handshake (at most 5 s) showing our client certificate (``tls``'s ``cert``
    and ``key``) if any (an etcd that requires one ends it without)."""
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
            if tls.cert is not None and tls.key is not None:
                context.load_cert_chain(write("cert.pem", tls.cert), write("key.pem", tls.key))
            with (
                socket.create_connection((endpoint.host, endpoint.port), timeout=5.0) as sock,
                context.wrap_socket(sock, server_hostname=endpoint.host) as secured,
            ):
                der = secured.getpeercert(binary_form=True)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"cannot fetch the TLS certificate of {endpoint}: {exc}") from None
        if der is None:
            raise Unavailable(f"{endpoint} presented no TLS certificate")
        pem = ssl.DER_cert_to_PEM_cert(der)
        try:
            decoded = ssl._ssl._test_decode_cert(write("server.pem", pem.encode()))  # type: ignore[attr-defined]
        except (ssl.SSLError, AttributeError):
            decoded = {}
    alt = decoded.get("subjectAltName", ())
    names = [v for k, v in alt if k == "DNS"] + [v for k, v in alt if k == "IP Address"]
    return pem.encode(), names[0] if names and endpoint.host not in names else endpoint.host


@dataclass(frozen=True)
class Credentials:
    """An etcd user and its password (never logged, never shown)."""

    user: str
    password: str = field(repr=False)


class Stubs(NamedTuple):
    """One channel to one member and the etcd services' stubs on it: blocking ``grpc``
    calls, or (``dial(..., loop_native=True)``) ``grpc.aio`` ones on the loop running then."""

    channel: Any  # grpc.Channel, or grpc.aio.Channel
    kv: pb.KVStub
    lease: pb.LeaseStub
    watch: pb.WatchStub
    maintenance: pb.MaintenanceStub
    auth: pb.AuthStub

    @classmethod
    def dial(cls, endpoint: Endpoint, tls: TLS | None, loop_native: bool = False) -> Stubs:
        """Raises Unavailable when skip_verify cannot fetch the endpoint's certificate."""
        global _dialled_in
        _dialled_in = os.getpid()
        stack: Any = grpc.aio if loop_native else grpc
        if endpoint.tls or tls is not None:
            creds, options = (tls or TLS()).credentials(endpoint)
            channel = stack.secure_channel(endpoint.target, creds, options=options)
        else:
            channel = stack.insecure_channel(endpoint.target, options=CHANNEL_OPTIONS)
        if loop_native:
            loop_channels.add(channel)
        services = (pb.KVStub, pb.LeaseStub, pb.WatchStub, pb.MaintenanceStub, pb.AuthStub)
        return cls(channel, *(stub(channel) for stub in services))


# The process that last dialled a channel: a child forked from it inherits gRPC's state.
_dialled_in: int | None = None
_FALSE = ("0", "false", "no", "n", "f", "off")


def check_fork_support() -> None:
    """Raise UsageError in a process forked from one that used gRPC when gRPC's fork support
    is off (GRPC_ENABLE_FORK_SUPPORT=false): its first call would hang past every deadline
    (found with multiprocessing's fork start method)."""
    setting = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").strip().lower()
    if _dialled_in not in (None, os.getpid()) and setting in _FALSE:
        raise UsageError(
            f"gRPC was used in process {_dialled_in} before it forked this one, and "
            f"GRPC_ENABLE_FORK_SUPPORT={setting}: a forked process cannot use gRPC then; "
            "leave GRPC_ENABLE_FORK_SUPPORT unset (or true) in the parent"
        )


def check_timeout(parameter: str, seconds: float, zero: bool = False) -> None:
    """Raise UsageError naming ``parameter`` unless ``seconds`` is a number above 0 (or 0
    itself, with ``zero``) and at most 10 years (gRPC would wait forever past that)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(f"bad {parameter} {seconds!r}: want seconds, a number")
    lowest_ok = seconds >= 0 if zero else seconds > 0
    if not (math.isfinite(seconds) and lowest_ok and seconds <= MAX_TIMEOUT):
        above = "0 or more" if zero else "above 0"
        raise UsageError(f"bad {parameter} {seconds!r}: want seconds {above}, at most 10 years")


def parse_endpoints(endpoints: str | Sequence[str]) -> list[Endpoint]:
    """``endpoints`` (comma-separated, or a list) parsed; UsageError for a bad one or none."""
    texts = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [Endpoint.parse(t) for t in texts if t.strip()]
    if not parsed:
        raise UsageError(f"bad endpoints {endpoints!r}: no endpoint given")
    return parsed


# grpc.aio channels open. gRPC's asyncio stack does not survive a fork while any is (its
# poller thread stays in the parent; a child's calls hung past their deadlines): a child
# forked then uses the blocking stack for its coroutines too (``loop_native``).
loop_channels: weakref.WeakSet[Any] = weakref.WeakSet()
# The child keeps those referenced for good: gRPC's destructor, run there, hung the child or
# wrote into the connection it shares with the parent (which then lost its keepalives).
_parents_channels: list[Any] = []
os.register_at_fork(after_in_child=lambda: _parents_channels.extend(loop_channels))


def loop_native() -> bool:
    """Whether coroutines may use gRPC's asyncio stack here: not in a process forked (at any
    depth) while grpc.aio channels were open."""
    return not _parents_channels
