"""The command line: argparse -> the public API -> exit codes. No etcd logic here."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

from conch import __version__, log
from conch.errors import ConchError, Interrupted, NoSlot, Unavailable, UsageError
from conch.etcd import ETCD_API_VERSION, Client
from conch.etcd.client import TLS, Credentials, connect
from conch.flag import Flag
from conch.identity import Identity
from conch.keys import check_host, check_max, check_name
from conch.semaphore import Semaphore
from conch.supervisor import (
    adopt_orphans,
    check_kill_after,
    default_kill_after,
    start_watchdog,
    stop_on_signals,
    supervise,
)

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"\d+\.?\d*|\.\d+")
MAX_DURATION = 10 * 365 * 86400.0  # seconds; beyond this timeouts overflow, and mean nothing


def parse_duration(flag: str, text: str) -> float:
    """Go-style duration (``500ms``, ``1.5s``, ``1h30m``; a bare number is seconds) in
    seconds. Raises UsageError naming ``flag`` and the value."""
    value = text.strip()
    if _NUMBER.fullmatch(value):
        total = float(value)
    else:
        pos, total = 0, 0.0
        for match in _PART.finditer(value):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNITS[match.group(2)]
            pos = match.end()
        if pos != len(value) or not value or not math.isfinite(total):
            raise UsageError(
                f"bad {flag} {text!r}: want a duration like 500ms, 10s, 1.5s, 2m, 1h30m"
            )
    if total > MAX_DURATION:
        raise UsageError(f"bad {flag} {text!r}: longer than 10 years")
    return total


def parse_ttl(flag: str, text: str) -> int:
    seconds = parse_duration(flag, text)
    if seconds < 1 or seconds != int(seconds):
        raise UsageError(f"bad {flag} {text!r}: the lease TTL is whole seconds >= 1")
    return int(seconds)


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, sized to the terminal as argparse does but without
    importing shutil: argparse makes one for every add_argument(), and shutil's import
    (bz2, lzma) was about 2.5 ms of every run's start-up (bench/startup.py)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs.setdefault("width", _columns() - 2)
        super().__init__(prog, **kwargs)


def _columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else stdout's terminal, else 80."""
    with contextlib.suppress(ValueError):
        columns = int(os.environ.get("COLUMNS", "0"))
        if columns > 0:
            return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            message += " (the command goes after --: conch sema NAME --max N -- CMD...)"
        raise UsageError(message)


def _env(name: str, default: str) -> tuple[str, str]:
    """(value, where it came from) for an env fallback."""
    if name in os.environ:
        return os.environ[name], name
    return default, "default"


def build_parser() -> argparse.ArgumentParser:
    """The parser the CLI and the man page are made from."""
    parser = _Parser(
        prog="conch",
        description="flock(1) for a whole cluster: run a command only while holding one of N "
        "slots of a semaphore counted across every machine sharing an etcd v3 cluster.",
        epilog="Exit codes: the child's (128+S if killed by signal S); 64 usage error; "
        "69 etcd unreachable or no session; 70 hold lost while the child ran (child killed); "
        "75 no slot (--nonblock or --wait ran out); 126/127 command not executable / not found.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"conch {__version__} (etcd API v{ETCD_API_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sema = sub.add_parser(
        "sema",
        help="run CMD while holding one of --max slots of semaphore NAME",
        usage="conch sema NAME --max N [--ttl DUR] [--wait DUR | --nonblock] [--spread] "
        "[--kill-after DUR] [--endpoints LIST] [--dial-timeout DUR] [--quiet] -- CMD...\n"
        "       conch sema NAME [--max N] --who [--json] [--endpoints LIST]",
        description="Run CMD only while holding one of N slots of the semaphore NAME, counted "
        "across every machine that shares the etcd cluster; kill CMD the moment the hold is "
        "lost. With --who, list the holders and waiters instead.",
        epilog="Durations are Go-style (500ms, 10s, 1.5s, 2m, 1h30m; a bare number is "
        "seconds). CONCH_HOST overrides the host name. The child gets CONCH_NAME, CONCH_REV "
        "(fencing token), CONCH_LEASE and CONCH_MAX. State changes are logged to stderr as "
        "key=value lines (-q: warnings and errors only). Exit codes: the child's; 64 usage; "
        "69 etcd unreachable; 70 hold lost; 75 no slot; 126/127 cannot run / not found; "
        "128+S signal S while queued.",
    )
    sema.add_argument("name", metavar="NAME", help="semaphore name (1-200 bytes of UTF-8)")
    sema.add_argument(
        "--max",
        dest="max_holders",
        metavar="N",
        help="capacity N >= 1 (required to run a command); part of the semaphore's identity",
    )
    sema.add_argument(
        "--ttl", metavar="DUR", help="session lease TTL, whole seconds (env CONCH_TTL, default 10s)"
    )
    waiting = sema.add_mutually_exclusive_group()
    waiting.add_argument(
        "--wait",
        metavar="DUR",
        help="wait at most DUR for a slot, then exit 75 (default: wait forever)",
    )
    waiting.add_argument(
        "--nonblock",
        "-n",
        action="store_true",
        help="do not wait: exit 75 at once if no slot is free (--wait 0)",
    )
    sema.add_argument(
        "--spread",
        action="store_true",
        help="at most one slot per host (key ends in the host name)",
    )
    sema.add_argument(
        "--kill-after",
        metavar="DUR",
        help="SIGTERM -> SIGKILL escalation, planned back from the lease's earliest expiry "
        "so that the child is dead before it; at most TTL - TTL/3 - margins (1.25s at "
        "--ttl 3s, 5.4s at 10s), longer is a usage error (env CONCH_KILL_AFTER; default 5s, "
        "less below --ttl 19s: 2.07s at 10s, so that a slow keepalive is waited for as long "
        "as without a grace)",
    )
    sema.add_argument(
        "--who",
        action="store_true",
        help="list holders and waiters (read-only); exit 0 if any, 1 if none",
    )
    sema.add_argument("--json", action="store_true", help="with --who: one JSON object per line")
    sema.add_argument(
        "--endpoints",
        metavar="LIST",
        help="comma-separated host:port or "
        "http(s)://host:port (env CONCH_ENDPOINTS, default 127.0.0.1:2379)",
    )
    sema.add_argument(
        "--dial-timeout",
        metavar="DUR",
        help="give up connecting after DUR (env CONCH_DIAL_TIMEOUT, default 5s)",
    )
    sema.add_argument("--quiet", "-q", action="store_true", help="log only warnings and errors")
    security = sema.add_argument_group("TLS and authentication (named as etcdctl names them)")
    security.add_argument(
        "--cacert",
        metavar="FILE",
        help="CA bundle to verify etcd's certificate; implies TLS (env CONCH_CACERT)",
    )
    security.add_argument(
        "--cert", metavar="FILE", help="client certificate for mutual TLS (env CONCH_CERT)"
    )
    security.add_argument("--key", metavar="FILE", help="client key for mutual TLS (env CONCH_KEY)")
    security.add_argument(
        "--insecure-skip-tls-verify",
        action="store_true",
        help="trust whatever certificate etcd presents: encrypted, but open to a man in the "
        "middle (env CONCH_INSECURE_SKIP_TLS_VERIFY=1)",
    )
    security.add_argument("--user", metavar="NAME[:PASSWORD]", help="etcd user (env CONCH_USER)")
    security.add_argument(
        "--password",
        metavar="PASSWORD",
        help="etcd password; prefer env CONCH_PASSWORD or --password-file, which stay out of argv",
    )
    security.add_argument(
        "--password-file",
        metavar="FILE",
        help="read the etcd password from FILE (env CONCH_PASSWORD_FILE)",
    )
    return parser


def _setting(flag: str, given: str | None, env: str, default: str) -> tuple[str, str]:
    if given is not None:
        return given, flag
    return _env(env, default)


def _read_file(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _tls(args: argparse.Namespace) -> TLS | None:
    files: dict[str, bytes] = {}
    for flag, attr, env in (
        ("--cacert", "cacert", "CONCH_CACERT"),
        ("--cert", "cert", "CONCH_CERT"),
        ("--key", "key", "CONCH_KEY"),
    ):
        path, source = _setting(flag, getattr(args, attr), env, "")
        if path:
            files[attr] = _read_file(source, path)
    if ("cert" in files) != ("key" in files):
        raise UsageError("--cert and --key go together")
    if files:
        _check_pem(files)
    skip = args.insecure_skip_tls_verify or _env_flag("CONCH_INSECURE_SKIP_TLS_VERIFY")
    if not files and not skip:
        return None
    return TLS(files.get("cacert"), files.get("cert"), files.get("key"), skip_verify=skip)


_PEM_CERTIFICATE = rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----"


def _check_pem(files: dict[str, bytes]) -> None:
    """Usage error unless the CA bundle holds certificates and the client certificate and key
    load as a pair (gRPC would only say so in its own log lines, then fail the dial)."""
    import ssl
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if "cacert" in files:
        # Only the PEM blocks: a bundle's comments may be in any encoding (Mozilla's are
        # UTF-8), and ssl takes PEM text in ASCII only.
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


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _credentials(args: argparse.Namespace) -> Credentials | None:
    """The user and password: a flag beats an env var (NAME:PASSWORD in --user, then
    --password, then --password-file; then the same from CONCH_USER, CONCH_PASSWORD and
    CONCH_PASSWORD_FILE)."""
    user, _ = _setting("--user", args.user, "CONCH_USER", "")
    if not user:
        if args.password is not None or args.password_file is not None:
            raise UsageError("--password and --password-file need --user")
        return None
    name, _, inline = user.partition(":")
    from_flag = args.user is not None
    password = _password(
        inline if from_flag else "", args.password, "--password-file", args.password_file
    ) or _password(
        "" if from_flag else inline,
        os.environ.get("CONCH_PASSWORD"),
        "CONCH_PASSWORD_FILE",
        os.environ.get("CONCH_PASSWORD_FILE") or None,
    )
    if not name or not password:
        raise UsageError(
            "--user needs a name and a password (NAME:PASSWORD, --password, "
            "CONCH_PASSWORD or --password-file)"
        )
    return Credentials(name, password)


def _password(inline: str, given: str | None, file_source: str, path: str | None) -> str:
    """The password from one source, flags or environment: NAME:PASSWORD, else the password
    itself, else the file's content without its line end; empty if none is given."""
    if inline or given:
        return inline or given or ""
    if path is None:
        return ""
    return _read_file(file_source, path).decode("utf-8", "replace").rstrip("\r\n")


def _connect(args: argparse.Namespace) -> Client:
    endpoints_text, _ = _setting("--endpoints", args.endpoints, "CONCH_ENDPOINTS", "127.0.0.1:2379")
    dial_text, source = _setting("--dial-timeout", args.dial_timeout, "CONCH_DIAL_TIMEOUT", "5s")
    flag = source if source != "default" else "--dial-timeout"
    dial_timeout = parse_duration(flag, dial_text)
    if dial_timeout <= 0:
        raise UsageError(f"bad {flag} {dial_text!r}: want a duration above 0")
    return connect(endpoints_text, dial_timeout, tls=_tls(args), credentials=_credentials(args))


def _parse_max(text: str | None) -> int | None:
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
        raise UsageError(f"bad --max {text!r}: want a whole number, 1 to 1000000")
    value = int(text)
    check_max(value, "--max")
    return value


def _who(args: argparse.Namespace, max_holders: int | None) -> int:
    # Imported here: only --who lists (~1 ms of every other start, measured with -X importtime).
    from conch.listing import who

    with _connect(args) as client:
        records = who(client, args.name, max_holders)
    capacities = sorted({r.max for r in records}, key=lambda c: -1 if c is None else c)
    if len(capacities) > 1 or (max_holders is not None and capacities != [max_holders]):
        for capacity in capacities:
            if capacity != max_holders:
                log.warning(
                    "other-capacity",
                    name=args.name,
                    max="?" if capacity is None else capacity,
                    hint="one name, several --max: these are separate semaphores",
                )
    for record in records:
        print(record.to_json() if args.json else record.to_text())
    sys.stdout.flush()
    held = [r for r in records if r.state == "HELD" and max_holders in (None, r.max)]
    return 0 if held else 1


class _RunSettings(NamedTuple):
    ttl: int  # seconds
    kill_after: float  # seconds
    wait: float | None  # seconds; None: forever


def _run_settings(args: argparse.Namespace) -> _RunSettings:
    """--ttl, --kill-after and --wait (or their env vars), checked whatever the mode: a bad
    value is a usage error even where it would not be used (--who)."""
    ttl_text, ttl_source = _setting("--ttl", args.ttl, "CONCH_TTL", "10s")
    ttl = parse_ttl("--ttl" if ttl_source == "default" else ttl_source, ttl_text)
    ka_text, ka_source = _setting("--kill-after", args.kill_after, "CONCH_KILL_AFTER", "5s")
    kill_after = parse_duration("--kill-after" if ka_source == "default" else ka_source, ka_text)
    # The child must be dead before its lease can expire: a grace asked for that cannot fit
    # the TTL is refused (64) rather than quietly cut; the default is cut to what leaves
    # each keepalive its whole patience.
    if ka_source == "default":
        kill_after = default_kill_after(ttl, kill_after)
    else:
        check_kill_after(kill_after, ttl, ka_source)
    wait = 0.0 if args.nonblock else None
    if args.wait is not None:
        wait = parse_duration("--wait", args.wait)
    return _RunSettings(ttl, kill_after, wait)


def _parse(words: list[str]) -> argparse.Namespace:
    """The arguments before ``--``. A NAME that starts with a single ``-`` (``-x``) is taken
    as the NAME when it comes right after ``sema``, is not one of our options (``-n``,
    ``-q``: there a forgotten NAME stays an error), and the words do not parse otherwise."""
    parser = build_parser()
    try:
        return parser.parse_args(words)
    except UsageError as error:
        first = words[1] if len(words) > 1 and words[0] == "sema" else ""
        if not first.startswith("-") or first.startswith("--") or _options(parser, first):
            raise
        try:
            return parser.parse_args([words[0], *words[2:], "--", first])
        except UsageError:
            raise error from None


def _options(parser: argparse.ArgumentParser, word: str) -> bool:
    """Whether ``word`` parses as options of ``sema`` (``-n``, ``-qn``)."""
    try:
        parser.parse_args(["sema", word, "name"])
    except UsageError:
        return False
    return True


_NOT_WITH_WHO = (
    ("--ttl", "ttl", None),
    ("--wait", "wait", None),
    ("--nonblock", "nonblock", False),
    ("--spread", "spread", False),
    ("--kill-after", "kill_after", None),
)


def _run(
    args: argparse.Namespace,
    max_holders: int,
    cmd: Sequence[str],
    settings: _RunSettings,
    exiting: bool,
) -> int:
    ttl, kill_after, wait = settings.ttl, settings.kill_after, settings.wait
    identity = Identity.current(cmd)
    check_host(identity.host)
    if exiting:
        adopt_orphans()  # the process is ours: reap whatever the child leaves behind
    # Its interpreter starts while we connect, instead of after (~20 ms of the run). When it
    # cannot be started, supervise() tries again and reports it.
    watchdog = None
    with contextlib.suppress(OSError):
        watchdog = start_watchdog(kill_after)
    # Dialling writes nothing, so a signal then may simply end us (the watchdog, with no
    # child announced, exits at the end of its pipe); from the first write on, signals are
    # caught and withdraw or forward. When the process exits right after (``exiting``),
    # they stay caught: a late one must not replace the child's status.
    try:
        with (
            _connect(args) as client,
            stop_on_signals(Flag("stop"), restore=not exiting) as stop,
        ):
            sema = Semaphore(client, args.name, max_holders, ttl, args.spread, identity)
            try:
                return supervise(sema, cmd, wait, kill_after, stop, watchdog)
            except NoSlot as exc:
                log.info("timeout", name=args.name, max=max_holders, reason=str(exc))
                return exc.exit_code
            except Interrupted as exc:
                log.info("interrupted", name=args.name, signum=exc.signum)
                return exc.exit_code
    finally:
        if watchdog is not None:  # unused: the connection failed
            watchdog.dismiss()


def run() -> NoReturn:
    """The ``conch`` command: ``main()``, then exit at once. Skipping the interpreter's
    teardown saves tens of milliseconds and cannot hang on a gRPC object finalized while a
    stream thread is frozen mid-shutdown; everything conch owns is released by then."""
    _reopen_closed_std_fds()
    _undo_locale_coercion()
    _slow_grpc_polling()
    # Started with SIGCHLD ignored (possible from a parent that ignores it and execs us),
    # the kernel would reap the child itself and its status would be lost.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = main(exiting=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


# Started in the C locale, Python sets LC_CTYPE to a UTF-8 locale in its own environment
# (PEP 538 locale coercion), which a child would inherit: a cron job (LANG unset) would run
# in another locale under conch than without it.
_COERCED_LC_CTYPE = ("C.UTF-8", "C.utf8", "UTF-8")


def _started_with(name: str) -> str | None:
    """``name``'s value in the environment this process was started with (Linux's
    /proc/self/environ keeps it as exec() gave it), None if it had none; ``os.environ``'s
    value when that cannot be read."""
    prefix = name.encode() + b"="
    try:
        with open("/proc/self/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError:
        return os.environ.get(name)
    found = [entry[len(prefix) :] for entry in entries if entry.startswith(prefix)]
    return os.fsdecode(found[0]) if found else None


def _undo_locale_coercion() -> None:
    """The command's children get the environment it was started with: Python's own
    LC_CTYPE goes (the caller's, if it had one, comes back). Only the command: a service
    that embeds conch may have set LC_CTYPE itself."""
    if os.environ.get("LC_CTYPE") in _COERCED_LC_CTYPE:
        given = _started_with("LC_CTYPE")
        if given is None:
            del os.environ["LC_CTYPE"]
        else:
            os.environ["LC_CTYPE"] = given  # LC_CTYPE=C or POSIX, coerced too


def _slow_grpc_polling() -> None:
    """gRPC's blocking stream iterators wake every 0.1 s (``grpc._common``'s
    MAXIMUM_WAIT_TIMEOUT) so that a main thread blocked in one can take a KeyboardInterrupt.
    conch reads its streams in threads of its own, where that polling only burns CPU: 1.4 ms
    a second per waiting process, measured, 15% of a core for 100 waiters. The command owns
    its interpreter, so it wakes them every 5 s instead (the library leaves gRPC alone)."""
    import grpc._common

    if isinstance(getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", None), float):
        grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0


def _reopen_closed_std_fds() -> None:
    """Started with stdin, stdout or stderr closed (cron's ``>&-``): point them at /dev/null,
    so neither our logging nor the child's inherited fds land somewhere unexpected."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115


def main(argv: Sequence[str] | None = None, exiting: bool = False) -> int:
    """Entry point of ``conch``; returns the exit code (contract section 8). ``exiting``:
    the process exits right after, so stop signals stay caught to the end."""
    log.to_stderr()
    words = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in words:
        split = words.index("--")
        words, cmd = words[:split], words[split + 1 :]
    try:
        args = _parse(words)
        if args.command != "sema":
            raise UsageError("missing command: try 'conch sema NAME --max N -- CMD...'")
        log.set_quiet(args.quiet)
        max_holders = _parse_max(args.max_holders)
        check_name(args.name)
        settings = _run_settings(args)
        if args.who:
            if cmd:
                raise UsageError("--who takes no command")
            for flag, attr, unset in _NOT_WITH_WHO:
                if getattr(args, attr) != unset:
                    raise UsageError(f"--who takes no {flag}")
            return _who(args, max_holders)
        if args.json:
            raise UsageError("--json goes with --who")
        if max_holders is None:
            raise UsageError("missing --max N")
        if not cmd:
            raise UsageError("missing command: conch sema NAME --max N -- CMD...")
        return _run(args, max_holders, cmd, settings, exiting)
    except UsageError as exc:
        print(f"conch: {exc}", file=sys.stderr)
        return exc.exit_code
    except Unavailable as exc:
        log.error("unavailable", error=str(exc))
        return exc.exit_code
    except ConchError as exc:
        log.error("failed", error=str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
