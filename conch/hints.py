"""What the command says about what it was given: values cut for messages, the flag an
operator most likely meant (habits of flock, consul lock and etcdctl, else difflib's close
matches), and a hint at ``sh -c`` for a command that looks like a shell line; no etcd here."""

from __future__ import annotations

import re
from collections.abc import Iterable

SHOWN_MAX = 64  # characters of a value echoed in a message

# Options other tools take, and what an "unknown option" message says after the option.
_HABITS = {
    option: (f": did you mean {meant}? " if meant else " ") + f"({why.format(option)})"
    for options, meant, why in (
        ("-w --timeout", "--wait", "flock's {}: conch takes --wait DUR, e.g. --wait 10s"),
        ("-timeout", "--wait", "consul lock's {}: conch takes --wait DUR, e.g. --wait 10s"),
        ("--nowait --no-wait --nb", "--nonblock", "exit 75 at once if no slot is free"),
        ("-x -e --exclusive", "--max 1", "one holder at a time is --max 1"),
        ("-s --shared", "--max N", "N holders at a time is --max N"),
        ("-E", "", "conch exits 75 when no slot is free (--nonblock, --wait); not settable"),
        ("--conflict-exit-code", "", "conch exits 75 when no slot is free; not settable"),
        ("-v --verbose -verbose", "", "conch logs every state change unless -q; --debug logs more"),
        ("-V --version", "conch --version", "the version is an option of conch itself"),
        ("-c --command", "", "flock's {}: conch runs a shell line as -- sh -c '...'"),
        ("-command", "", "conch runs a shell line as -- sh -c '...'"),
    )
    for option in options.split()
}

_SHELL_CHARACTERS = frozenset(" \t\n;&|<>()$`\\\"'*?[]{}~#=")


def shown(value: str) -> str:
    """``value`` as a message quotes it (``repr``), its first SHOWN_MAX characters only when
    it is longer, with its length: a 10,000-character name is not echoed whole."""
    if len(value) <= SHOWN_MAX:
        return repr(value)
    return f"{value[:SHOWN_MAX]!r}... ({len(value)} characters)"


def cut_quoted(message: str) -> str:
    """``message`` (argparse's, which quotes what it was given) with each quoted value longer
    than SHOWN_MAX characters cut as ``shown`` cuts it."""
    return re.sub(f"'([^']{{{SHOWN_MAX + 1},}})'", lambda m: shown(m.group(1)), message)


def unknown_option(word: str, options: Iterable[str], before_subcommand: bool = False) -> str:
    """The message for an option the parser does not take where it was given: the flag meant,
    where a habit or a close match says which, or (``before_subcommand``) that one of
    ``options`` (the parser's option strings) goes after the subcommand."""
    given = word.split("=", 1)[0]
    if before_subcommand and given in options:
        return f"{given} goes after the subcommand: conch sema NAME {given} ..."
    habit = _HABITS.get(given)
    if habit is None and not given.startswith("--") and len(given) > 2:
        habit = _HABITS.get(given[:2])  # -w10, as flock takes it
    if habit is not None:
        return f"unknown option {shown(given)}{habit}"
    import difflib  # only on this error path

    longs = [option for option in options if option.startswith("--")]
    if given.startswith("--") and len(given) > 2:
        whole = sorted({option for option in longs if option.startswith(given)})
        if whole:
            return (
                f"unknown option {shown(given)}: did you mean {' or '.join(whole)}? "
                "(options are not abbreviated)"
            )
    spelled = given if given.startswith("--") else "-" + given  # -nonblock, as consul spells
    close = difflib.get_close_matches(spelled, longs, n=1, cutoff=0.6)
    if close:
        return f"unknown option {shown(given)}: did you mean {close[0]}?"
    return f"unknown option {shown(given)} (conch sema --help lists them)"


def not_found(argv0: str) -> dict[str, str]:
    """Fields to add to the ``child-not-found`` line: a hint at ``sh -c`` when the missing
    command's name looks like a shell line; none otherwise."""
    if any(c in _SHELL_CHARACTERS for c in argv0):
        return {"hint": "a shell line is not a command name: run it as -- sh -c '...'"}
    return {}
