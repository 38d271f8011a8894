"""The command's settings: durations, and the connection (endpoints, dial timeout, TLS, user),
each from its flag, else ``CONCH_<NAME>``, else etcdctl's ``ETCDCTL_<NAME>``, else the default
(docs/design.md, "Where the command's settings come from"). ``--debug`` logs where each one
came from; a password is never shown."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from conch import log, procs
from conch.errors import UsageError
from conch.etcd.client import TLS, Client, Credentials, Endpoint, connect
from conch.hints import shown

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
_NUMBER = r"\d+\.?\d*|\.\d+"
_PART = re.compile(f"({_NUMBER})({'|'.join(_UNITS)})")  # "ms" before "m": the first unit wins
MAX_DURATION = 10 * 365 * 86400.0  # seconds; beyond this timeouts overflow, and mean nothing
_EXAMPLES = "want a duration like 500ms, 10s, 1.5s, 2m, 1h30m"
_PEM_CERTIFICATE = rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----"


def parse_duration(flag: str, text: str) -> float:
    """Go-style duration (``500ms``, ``1.5s``, ``1h30m``; a bare number is seconds) in
    seconds. Raises UsageError naming ``flag`` and the value (cut if long)."""
    value = text.strip()
    if value.startswith("-"):
        raise UsageError(f"bad {flag} {shown(text)}: a duration is not negative; {_EXAMPLES}")
    if re.fullmatch(_NUMBER, value):
        total = float(value)
    elif re.fullmatch(f"(?:{_PART.pattern})+", value):  # then findall() is linear
        total = sum(float(n) * _UNITS[u] for n, u in _PART.findall(value))
    else:
        raise UsageError(f"bad {flag} {shown(text)}: {_EXAMPLES}")
    if total > MAX_DURATION:
        raise UsageError(f"bad {flag} {shown(text)}: longer than 10 years")
    return total


def parse_ttl(flag: str, text: str) -> int:
    """A lease TTL: a duration of whole seconds >= 1 (etcd's unit). Raises UsageError."""
    seconds = parse_duration(flag, text)
    if seconds < 1 or seconds != int(seconds):
        raise UsageError(f"bad {flag} {shown(text)}: the lease TTL is whole seconds >= 1")
    return int(seconds)


class Setting(NamedTuple):
    """A setting's text, where it came from (its flag, ``CONCH_X``, ``ETCDCTL_X`` or
    ``default``), and what a message about it names: the variable it came from, else the flag."""

    value: str
    source: str
    named: str


def setting(
    flag: str,
    given: str | None,
    name: str,
    default: str,
    environ: Mapping[str, str],
    prefixes: tuple[str, ...] = ("CONCH_", "ETCDCTL_"),
) -> Setting:
    """The setting ``name`` (``ENDPOINTS``): ``given`` (the flag's value) if not None, else
    the first of ``CONCH_<name>``, ``ETCDCTL_<name>`` in ``environ`` (``prefixes``:
    ``("CONCH_",)`` for what etcdctl has no equivalent of, ``CONCH_TTL``), else ``default``."""
    if given is not None:
        return Setting(given, flag, flag)
    for variable in (prefix + name for prefix in prefixes):
        if variable in environ:
            return Setting(environ[variable], variable, variable)
    return Setting(default, "default", flag)


class ConnectionFlags(NamedTuple):
    """The connection flags as given on the command line (None, False: not given)."""

    endpoints: str | None = None
    dial_timeout: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    insecure_skip_tls_verify: bool = False
    user: str | None = None
    password: str | None = None
    password_file: str | None = None


class Connection(NamedTuple):
    """Everything ``connect()`` needs, resolved: its arguments by name (seconds for time)."""

    endpoints: str
    dial_timeout: float
    tls: TLS | None
    credentials: Credentials | None

    def dial(self) -> Client:
        """A Client (conch.etcd.connect: Maintenance.Status, or Auth.Authenticate with
        credentials, within the dial timeout). Raises Unavailable, AuthenticationFailed."""
        return connect(**self._asdict())


def resolve(flags: ConnectionFlags, environ: Mapping[str, str]) -> Connection:
    """The connection settings from ``flags`` and ``environ`` (see the module). Reads the TLS
    and password files; logs each setting's source at debug level. Raises UsageError for a
    bad value or an unreadable file, naming the flag or variable it came from."""
    endpoints = setting("--endpoints", flags.endpoints, "ENDPOINTS", "127.0.0.1:2379", environ)
    texts = [text for text in endpoints.value.split(",") if text.strip()]
    if not texts:
        raise UsageError(f"bad {endpoints.named} {shown(endpoints.value)}: no endpoint")
    for text in texts:  # the message names the source: ETCDCTL_ENDPOINTS is easily forgotten
        try:
            Endpoint.parse(text)
        except UsageError:
            raise UsageError(
                f"bad endpoint {shown(text)} in {endpoints.named}: "
                "want host:port or http(s)://host:port"
            ) from None
    dial = setting("--dial-timeout", flags.dial_timeout, "DIAL_TIMEOUT", "5s", environ)
    dial_timeout = parse_duration(dial.named, dial.value)
    if dial_timeout <= 0:
        raise UsageError(f"bad {dial.named} {shown(dial.value)}: want a duration above 0")
    log.debug("setting", setting="endpoints", value=endpoints.value, source=endpoints.source)
    log.debug("setting", setting="dial-timeout", value=dial.value, source=dial.source)
    return Connection(
        endpoints.value, dial_timeout, _tls(flags, environ), _credentials(flags, environ)
    )


def _read_file(what: str, path: str) -> bytes:
    try:
        return procs._read(path)  # os calls: no pathlib (~2 ms of the command's start-up)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def truthy(text: str) -> bool:
    """An environment switch: ``1``, ``true``, ``yes``, ``on`` (etcdctl writes ``true``)."""
    return text.strip().lower() in ("1", "true", "yes", "on")


def _tls(flags: ConnectionFlags, environ: Mapping[str, str]) -> TLS | None:
    files: dict[str, bytes] = {}
    for name in ("cacert", "cert", "key"):
        found = setting("--" + name, getattr(flags, name), name.upper(), "", environ)
        if found.value:
            log.debug("setting", setting=name, value=found.value, source=found.source)
            files[name] = _read_file(found.named, found.value)
    if ("cert" in files) != ("key" in files):
        raise UsageError("--cert and --key go together")
    if files:
        _check_pem(files)
    given = "1" if flags.insecure_skip_tls_verify else None
    skip = setting("--insecure-skip-tls-verify", given, "INSECURE_SKIP_TLS_VERIFY", "", environ)
    skip_verify = truthy(skip.value)
    if skip_verify:
        log.debug("setting", setting="insecure-skip-tls-verify", value=1, source=skip.source)
    if not files and not skip_verify:
        return None
    return TLS(files.get("cacert"), files.get("cert"), files.get("key"), skip_verify=skip_verify)


def _check_pem(files: dict[str, bytes]) -> None:
    """Usage error unless the CA bundle holds certificates and the client certificate and key
    load as a pair (gRPC would only say so in its own log lines, then fail the dial)."""
    import ssl
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if "cacert" in files:
        # Only the PEM blocks: a bundle's comments may be in any encoding; ssl takes ASCII.
        blocks = re.findall(_PEM_CERTIFICATE, files["cacert"], re.DOTALL)
        try:
            context.load_verify_locations(cadata=b"\n".join(blocks).decode("ascii"))
        except (ssl.SSLError, ValueError):  # UnicodeDecodeError is a ValueError
            raise UsageError("bad --cacert: no PEM certificate in it") from None
    if "cert" in files:
        with tempfile.TemporaryDirectory(prefix="conch-") as scratch:
            cert, key = os.path.join(scratch, "cert"), os.path.join(scratch, "key")
            for path, data in ((cert, files["cert"]), (key, files["key"])):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(data)
            try:
                # An encrypted key fails here (empty password) instead of prompting.
                context.load_cert_chain(cert, key, password="")
            except (ssl.SSLError, ValueError):
                raise UsageError(
                    "bad --cert/--key: not a PEM certificate and its unencrypted private key"
                ) from None


def _credentials(flags: ConnectionFlags, environ: Mapping[str, str]) -> Credentials | None:
    """The user and password. The user as any setting (``--user``, ``CONCH_USER``,
    ``ETCDCTL_USER``; ``NAME:PASSWORD`` as etcdctl takes it). The password from the first
    level that gives one, flags before ``CONCH_*`` before ``ETCDCTL_*``: at each, the
    ``:PASSWORD`` of a user given there, then the password, then the password file."""
    user = setting("--user", flags.user, "USER", "", environ)
    if not user.value:
        if flags.password is not None or flags.password_file is not None:
            raise UsageError("--password and --password-file need --user")
        return None
    name, _, inline = user.value.partition(":")
    given = {**environ, "--password": flags.password, "--password-file": flags.password_file}
    given["CONCH_PASSWORD_FILE"] = environ.get("CONCH_PASSWORD_FILE") or None  # empty: unset
    password, source = "", ""
    for user_source, password_source, path_source in (
        ("--user", "--password", "--password-file"),
        ("CONCH_USER", "CONCH_PASSWORD", "CONCH_PASSWORD_FILE"),
        ("ETCDCTL_USER", "ETCDCTL_PASSWORD", ""),
    ):
        path = given.get(path_source)
        if user.source == user_source and inline:
            password, source = inline, f"{user_source} (NAME:PASSWORD)"
        elif given.get(password_source):
            password, source = given[password_source] or "", password_source
        elif path is not None:
            data = _read_file(path_source, path)
            password, source = data.decode("utf-8", "replace").rstrip("\r\n"), path_source
        if password:
            break
    if not name or not password:
        raise UsageError(
            "--user needs a name and a password (NAME:PASSWORD, --password, "
            "CONCH_PASSWORD or --password-file)"
        )
    log.debug("setting", setting="user", value=name, source=user.source)
    log.debug("setting", setting="password", value="(not shown)", source=source)
    return Credentials(name, password)
