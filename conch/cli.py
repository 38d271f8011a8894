"""The command line: argparse -> the public API -> exit codes. No etcd logic here."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from conch import __version__, hints, log, procs, supervisor
from conch.errors import (
    ConchError,
    Interrupted,
    NoSlot,
    Outcome,
    Unavailable,
    UsageError,
    exit_code,
    signalled,
)
from conch.etcd import ETCD_API_VERSION
from conch.flag import Flag
from conch.identity import Identity
from conch.keys import check_host, check_max, check_name
from conch.semaphore import Semaphore
from conch.settings import (
    Connection,
    ConnectionFlags,
    parse_duration,
    parse_ttl,
    resolve,
    setting,
    truthy,
)
from conch.watchdog import Watchdog

__all__ = ["build_parser", "main", "parse_duration", "parse_ttl", "run"]


class _Formatter(argparse.HelpFormatter):
    """argparse's, as wide as shutil.get_terminal_size() ($COLUMNS, else stdout's terminal,
    else 80), without shutil's import: ~2.5 ms, and argparse makes one per add_argument()."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        columns = 0
        with contextlib.suppress(ValueError):
            columns = int(os.environ.get("COLUMNS", "0"))
        if columns <= 0:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        super().__init__(prog, **{"width": (columns if columns > 0 else 80) - 2, **kwargs})


class _Parser(argparse.ArgumentParser):
    """argparse, errors raised as UsageError, no abbreviations (they break as options are added)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"formatter_class": _Formatter, "allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        raise UsageError(hints.cut_quoted(message))


class _Once(argparse.Action):
    """A single-valued option: given twice is a usage error, not "the last one wins" (a
    second ``--max`` in a long cron line would otherwise silently change the semaphore)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{self.option_strings[0]} given twice: give it once")
        setattr(namespace, self.dest, values)


# Options as "--flag[,-f] [METAVAR]": help; without a METAVAR, a switch. The connection
# options are taken before the subcommand too, as etcdctl's global flags are.
_CONNECTION = {
    "--endpoints LIST": "comma-separated host:port or http(s)://host:port "
    "(env CONCH_ENDPOINTS, then ETCDCTL_ENDPOINTS; default 127.0.0.1:2379)",
    "--dial-timeout DUR": "give up connecting after DUR (env CONCH_DIAL_TIMEOUT, then "
    "ETCDCTL_DIAL_TIMEOUT; default 5s)",
    "--cacert FILE": "CA bundle to verify etcd's certificate; implies TLS (env CONCH_CACERT, "
    "ETCDCTL_CACERT)",
    "--cert FILE": "client certificate for mutual TLS (env CONCH_CERT, ETCDCTL_CERT)",
    "--key FILE": "client key for mutual TLS (env CONCH_KEY, ETCDCTL_KEY)",
    "--insecure-skip-tls-verify": "trust whatever certificate etcd presents: encrypted, but "
    "open to a man in the middle (env CONCH_INSECURE_SKIP_TLS_VERIFY=1, "
    "ETCDCTL_INSECURE_SKIP_TLS_VERIFY=true)",
    "--user NAME[:PASSWORD]": "etcd user (env CONCH_USER, ETCDCTL_USER)",
    "--password PASSWORD": "etcd password; prefer --password-file (env CONCH_PASSWORD_FILE), "
    "which spreads nowhere: argv is shown by ps to every user, and CONCH_PASSWORD (or "
    "ETCDCTL_PASSWORD) in the environment can be read by every process of the same user, "
    "conch's job included, in /proc/PID/environ",
    "--password-file FILE": "read the etcd password from FILE (env CONCH_PASSWORD_FILE)",
    "--debug": "also log where each connection setting came from, and the traceback of a "
    "failure of conch's own (exit 70)",
}
_GLOBAL = "global_"  # the dest prefix of a connection option given before the subcommand
_SEMA = {
    "--max N": "capacity N >= 1 (required to run a command); part of the semaphore's identity",
    "--ttl DUR": "session lease TTL, whole seconds (env CONCH_TTL, default 10s)",
}
_WAITING = {  # one or the other
    "--wait DUR": "wait at most DUR for a slot, then exit 75 (default: wait forever)",
    "--nonblock,-n": "do not wait: exit 75 at once if no slot is free (--wait 0)",
}
_SEMA_AFTER = {
    "--spread": "at most one slot per host (key ends in the host name)",
    "--kill-after DUR": "SIGTERM -> SIGKILL escalation, planned back from the lease's earliest "
    "expiry so that the child is dead before it; at most TTL - TTL/3 - margins (1.25s at "
    "--ttl 3s, 5.41s at 10s), longer is a usage error (env CONCH_KILL_AFTER; default 5s, "
    "less below --ttl 19s: 2.07s at 10s, so that a slow keepalive is waited for as long "
    "as without a grace)",
    "--record-args": "store the whole command line in the holder's key, not only the program's "
    "name (env CONCH_RECORD_ARGS=1); anyone who can read the prefix, on any host, sees it",
    "--who": "list holders and waiters (read-only); exit 0 if any, 1 if none",
    "--json": "with --who: one JSON object per line",
    "--quiet,-q": "log only warnings and errors",
}


def _option(usage: str) -> tuple[list[str], str, str]:
    """The flags, dest and metavar ("" for a switch) of an option's ``usage``."""
    flags, _, metavar = usage.partition(" ")
    names = flags.split(",")
    return names, names[0][2:].replace("-", "_"), metavar


# Every option string, and whether it takes a value; those of the top level.
_OPTIONS = {
    flag: bool(_option(usage)[2])
    for table in (_CONNECTION, _SEMA, _WAITING, _SEMA_AFTER)
    for usage in table
    for flag in _option(usage)[0]
} | dict.fromkeys(("-h", "--help", "--version"), False)
_TOP = {"-h", "--help", "--version", *(_option(usage)[0][0] for usage in _CONNECTION)}
_RUN = "conch sema NAME --max N -- CMD..."
_NEGATIVE = re.compile(r"-\.?\d")  # -1s, -.5: a negative value, not an option
_NOT_WITH_WHO = ("--ttl", "--wait", "--nonblock", "--spread", "--kill-after", "--record-args")
_RunSettings = tuple[int, float, float | None, bool]  # ttl, kill-after, wait (None: forever)


def _add_options(
    group: argparse._ActionsContainer, options: Mapping[str, str], prefix: str = ""
) -> None:
    for usage, text in options.items():
        flags, dest, metavar = _option(usage)
        if metavar:
            group.add_argument(*flags, dest=prefix + dest, metavar=metavar, action=_Once, help=text)
        else:
            group.add_argument(*flags, dest=prefix + dest, action="store_true", help=text)


def build_parser() -> argparse.ArgumentParser:
    """The parser the CLI and the man page are made from."""
    parser = _Parser(
        prog="conch",
        description="flock(1) for a whole cluster: run a command only while holding one of N "
        "slots of a semaphore counted across every machine sharing an etcd v3 cluster.",
        epilog="Exit codes: the child's (128+S if killed by signal S); 64 usage error; "
        "69 etcd unreachable or no session; 70 hold lost while the child ran (child killed), or "
        "conch itself failed (child killed; one line, --debug for the traceback); "
        "75 no slot (--nonblock or --wait ran out); 126/127 command not executable / not found.",
    )
    parser.add_argument(
        "--version", action="version", version=f"conch {__version__} (etcd API v{ETCD_API_VERSION})"
    )
    connection = parser.add_argument_group(
        "connection (before or after the subcommand; flag, then CONCH_*, then etcdctl's ETCDCTL_*)"
    )
    _add_options(connection, _CONNECTION, _GLOBAL)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sema = sub.add_parser(
        "sema",
        help="run CMD while holding one of --max slots of semaphore NAME",
        usage="conch sema NAME --max N [--ttl DUR] [--wait DUR | --nonblock] [--spread] "
        "[--kill-after DUR] [--record-args] [--endpoints LIST] [--dial-timeout DUR] [--quiet] "
        "-- CMD...\n"
        "       conch sema NAME [--max N] --who [--json] [--endpoints LIST]",
        description="Run CMD only while holding one of N slots of the semaphore NAME, counted "
        "across every machine that shares the etcd cluster; kill CMD the moment the hold is "
        "lost. With --who, list the holders and waiters instead.",
        epilog="Durations are Go-style (500ms, 10s, 1.5s, 2m, 1h30m; a bare number is "
        "seconds). CONCH_HOST overrides the host name. The child gets CONCH_NAME, CONCH_REV "
        "(fencing token), CONCH_LEASE and CONCH_MAX, and none of conch's credentials: "
        "CONCH_USER, CONCH_PASSWORD, CONCH_PASSWORD_FILE, CONCH_CERT, CONCH_KEY and their "
        "ETCDCTL_ forms are removed, paths and secrets alike (the CA bundle and the "
        "endpoints are passed on); a conch or etcdctl in the job needs its own. State changes "
        "are logged to stderr as key=value lines (-q: warnings and errors only). Exit codes: "
        "the child's; 64 usage; 69 etcd unreachable; 70 hold lost or conch failed; 75 no "
        "slot; 126/127 cannot run / not found; 128+S signal S while queued.",
    )
    sema.add_argument("name", metavar="NAME", help="semaphore name (1-200 bytes of UTF-8)")
    _add_options(sema, _SEMA)
    _add_options(sema.add_mutually_exclusive_group(), _WAITING)
    _add_options(sema, _SEMA_AFTER)
    _add_options(
        sema.add_argument_group("connection, TLS and authentication (named as etcdctl names them)"),
        _CONNECTION,
    )
    return parser


def _parse_max(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
        raise UsageError(f"bad --max {hints.shown(text)}: want a whole number, 1 to 1000000")
    check_max(int(text), "--max")
    return int(text)


def _who(args: argparse.Namespace, max_holders: int | None, connection: Connection) -> int:
    # Imported here: only --who lists (~1 ms of every other start, measured with -X importtime).
    from conch.listing import who

    with connection.dial() as client:
        records = who(client, args.name, max_holders)
    capacities = sorted({r.max for r in records}, key=lambda c: -1 if c is None else c)
    for capacity in capacities:
        if capacity != max_holders and (len(capacities) > 1 or max_holders is not None):
            log.warning(
                "other-capacity",
                name=args.name,
                max="?" if capacity is None else capacity,
                hint="one name, several --max: these are separate semaphores",
            )
    try:
        for record in records:
            print(record.to_json() if args.json else record.to_text())
        sys.stdout.flush()
    except BrokenPipeError:
        # `--who | head -1`: quietly, with the status of a tool killed by SIGPIPE (ls, seq),
        # and stdout on /dev/null so that the exit's own flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    held = [r for r in records if r.state == "HELD" and max_holders in (None, r.max)]
    return exit_code(Outcome.LISTED if held else Outcome.NONE_HELD)


def _run_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> _RunSettings:
    """--ttl, --kill-after, --wait (seconds) and --record-args (or their env vars), checked
    whatever the mode: a bad value is a usage error even where it would not be used (--who)."""
    ttl_found = setting("--ttl", args.ttl, "TTL", "10s", environ, ("CONCH_",))
    ttl = parse_ttl(ttl_found.named, ttl_found.value)
    ka_found = setting("--kill-after", args.kill_after, "KILL_AFTER", "5s", environ, ("CONCH_",))
    kill_after = parse_duration(ka_found.named, ka_found.value)
    # The child must be dead before its lease can expire: a grace asked for that cannot fit
    # the TTL is refused (64); the default is cut to leave each keepalive its whole patience.
    if ka_found.source == "default":
        kill_after = supervisor.default_kill_after(ttl, kill_after)
    else:
        kill_after = supervisor.check_kill_after(kill_after, ttl, ka_found.named)
    wait = 0.0 if args.nonblock else None
    if args.wait is not None:
        wait = parse_duration("--wait", args.wait)
    given = "1" if args.record_args else None
    record = setting("--record-args", given, "RECORD_ARGS", "", environ, ("CONCH_",))
    record_args = truthy(record.value)
    log.debug("setting", setting="record-args", value=int(record_args), source=record.source)
    return ttl, kill_after, wait, record_args


def _negative_values_attached(words: list[str]) -> list[str]:
    """``--wait -1s`` as ``--wait=-1s``: argparse takes a word starting with ``-`` that is not a
    plain negative number for an option ("expected one argument"); attached, its check says why."""
    out: list[str] = []
    for word in words:
        if out and _OPTIONS.get(out[-1]) and _NEGATIVE.match(word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _parse_words(
    parser: argparse.ArgumentParser, words: list[str], has_cmd: bool
) -> argparse.Namespace:
    """``words`` parsed; what the parser does not take is a usage error that says which
    flag was meant (``-w``: ``--wait``), or where the command goes."""
    try:
        args, extras = parser.parse_known_args(words)
    except UsageError:
        # conch -w 10 sema: the unknown -w left 10 to be taken for the subcommand: talk of -w.
        for word in words[: words.index("sema")] if "sema" in words else words:
            if word.startswith("-") and word.split("=", 1)[0] not in _TOP:
                raise UsageError(hints.unknown_option(word, _OPTIONS, True)) from None
        raise
    for word in extras:
        if word.startswith("-") and word != "-":
            before = "sema" in words and words.index(word) < words.index("sema")
            raise UsageError(hints.unknown_option(word, _OPTIONS, before))
    if extras:
        where = "one NAME only" if has_cmd else f"the command goes after --: {_RUN}"
        raise UsageError(f"unexpected argument {hints.shown(extras[0])}: {where}")
    return args


def _parse(words: list[str], has_cmd: bool) -> argparse.Namespace:
    """The arguments before ``--`` (``has_cmd``: a ``--`` followed), with the connection
    options given before the subcommand (and not after it too). A NAME that starts with a
    single ``-`` is the NAME if it comes right after ``sema``, is not our switches (``-n``,
    ``-qn``: a forgotten NAME stays an error), and the words do not parse otherwise."""
    parser = build_parser()
    words = _negative_values_attached(words)
    try:
        args = _parse_words(parser, words, has_cmd)
    except UsageError as error:
        at = words.index("sema") if "sema" in words else -1
        first = words[at + 1] if 0 <= at < len(words) - 1 else ""
        switches = first[1:] and all(f"-{letter}" in _OPTIONS for letter in first[1:])
        if not first.startswith("-") or first.startswith("--") or switches:
            raise
        try:
            args = _parse_words(parser, [*words[: at + 1], *words[at + 2 :], "--", first], True)
        except UsageError:
            raise error from None
    for usage in _CONNECTION:
        flags, dest, metavar = _option(usage)
        before = getattr(args, _GLOBAL + dest)
        after = getattr(args, dest, None)
        if metavar and before is not None and after is not None:
            raise UsageError(f"{flags[0]} given twice: give it once")
        setattr(args, dest, after or before)
    return args


def _run(
    args: argparse.Namespace,
    max_holders: int,
    cmd: Sequence[str],
    settings: _RunSettings,
    connection: Connection,
    exiting: bool,
    watchdog: Watchdog | None,
) -> int:
    ttl, kill_after, wait, record_args = settings
    identity = Identity.current(cmd, record_args=record_args)
    check_host(identity.host)
    if exiting:
        supervisor.adopt_orphans()  # the process is ours: reap whatever the child leaves behind
    if watchdog is not None:  # started before the imports, closed by run(); else supervise()
        supervisor.start_watchdog(watchdog, None)  # starts one. Known to the adopting reaper.
    # Caught from the first write on (dialling writes nothing: a signal may simply end us);
    # with ``exiting`` they stay caught, as a late one must not replace the child's status.
    with (
        connection.dial() as client,
        supervisor.stop_on_signals(Flag("stop"), restore=not exiting) as stop,
    ):
        sema = Semaphore(client, args.name, max_holders, ttl, args.spread, identity)
        try:
            return supervisor.supervise(sema, cmd, wait, kill_after, stop, watchdog)
        except NoSlot as exc:
            log.info("timeout", name=args.name, max=max_holders, reason=str(exc))
            return exc.exit_code
        except Interrupted as exc:
            log.info("interrupted", name=args.name, signum=exc.signum)
            return exc.exit_code


def run(watchdog: Watchdog | None = None) -> NoReturn:
    """The ``conch`` command: ``main()`` (``watchdog``: started before the imports, closed
    if left unused), then exit at once. Skipping the interpreter's teardown saves tens of
    milliseconds and cannot hang on a gRPC object finalized while a stream thread is frozen
    mid-shutdown; everything conch owns is released by then."""
    # Its own process (std fds, locale: set up by __main__), SIGCHLD at its default: inherited
    # ignored, the kernel would reap the child, its status lost. Never the library's.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # gRPC's stream iterators wake every 0.1 s, in conch's threads for nothing (docs/design.md).
    import grpc._common

    if isinstance(getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", None), float):
        grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0
    code = main(exiting=True, watchdog=watchdog)
    if watchdog is not None:  # gone before conch: an outer conch would take it for escaped
        watchdog.close(supervisor.WATCHDOG_EXIT_TIMEOUT, reap=not procs._adopting)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(
    argv: Sequence[str] | None = None, exiting: bool = False, watchdog: Watchdog | None = None
) -> int:
    """Entry point of ``conch``; returns the exit code (contract section 8). ``exiting``:
    the process exits right after, so stop signals stay caught to the end; ``watchdog``:
    one started in advance, for a run."""
    log.to_stderr()
    words = list(sys.argv[1:] if argv is None else argv)
    split = words.index("--") if "--" in words else len(words)
    words, cmd, has_cmd = words[:split], words[split + 1 :], split < len(words)
    try:
        args = _parse(words, has_cmd)
        if args.command != "sema":
            raise UsageError(f"missing command: try '{_RUN}'")
        log.set_quiet(args.quiet)
        log.LOGGER.setLevel(logging.DEBUG if args.debug else logging.INFO)  # --debug
        max_holders = None if args.max is None else _parse_max(args.max)
        check_name(args.name)
        settings = _run_settings(args, os.environ)
        flags = ConnectionFlags(*(getattr(args, field) for field in ConnectionFlags._fields))
        connection = resolve(flags, os.environ)
        if args.who:
            if cmd:
                raise UsageError("--who takes no command")
            for flag in _NOT_WITH_WHO:
                if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
                    raise UsageError(f"--who takes no {flag}")
            return _who(args, max_holders, connection)
        if args.json:
            raise UsageError("--json goes with --who")
        if max_holders is None:
            raise UsageError("missing --max N")
        if not cmd:
            raise UsageError(f"missing command: {_RUN}")
        return _run(args, max_holders, cmd, settings, connection, exiting, watchdog)
    except Exception as exc:
        return _ending(exc, debug="--debug" in words)
    except KeyboardInterrupt:  # ^C while dialling, before signals are caught
        return exit_code(Outcome.INTERRUPTED, signalled(signal.SIGINT))


def _ending(exc: Exception, debug: bool) -> int:
    """One line on stderr for ``exc``, raised out of ``main``, and its exit code (ours: through
    EXIT_CODES). Any other is a bug of conch's: exit 70 (EX_SOFTWARE), a traceback only with
    ``debug`` (``--debug``); a child that ran was SIGKILLed before it left its supervision."""
    if isinstance(exc, UsageError):
        print(f"conch: {exc}", file=sys.stderr)
    elif isinstance(exc, ConchError):
        log.error("unavailable" if isinstance(exc, Unavailable) else "failed", error=str(exc))
    else:
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        log.error(
            Outcome.INTERNAL_ERROR.value,
            error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
            **({} if debug else {"hint": "rerun with --debug for the traceback"}),
        )
        return exit_code(Outcome.INTERNAL_ERROR)
    return exc.exit_code
