#!/usr/bin/env bash
# Make the bash, zsh and fish completions from the real argparse parser (shtab, a dev
# dependency; the installed conch does not need it).
#   scripts/gen_completions.sh           write completions/{bash/conch,zsh/_conch,fish/conch.fish}
#   scripts/gen_completions.sh --check   fail if they are not what the parser gives now
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
cd "$root"
generate() {  # $1: output directory
    "$python" - "$1" <<'PY'
import argparse
import sys
from pathlib import Path

import shtab

from conch.cli import build_parser

parser = build_parser()
commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
for each in (parser, *commands.choices.values()):  # connection options: before sema too
    for action in each._actions:
        if action.dest.removeprefix("global_") in ("cacert", "cert", "key", "password_file"):
            action.complete = shtab.FILE  # file names, not option names
# After --, the command and its arguments, as sudo, timeout and flock complete them: shtab
# knows nothing after --, since the parser never sees CMD (conch.cli splits it off).
BASH_COMMAND = r"""
# After --: the command's name, then what its own completion offers (bash-completion's
# _command_offset, as sudo's and timeout's completions use); without bash-completion,
# command names and then file names.
_conch_complete() {
  local i cur="${COMP_WORDS[COMP_CWORD]}"
  for ((i = 1; i < COMP_CWORD; i++)); do
    [[ ${COMP_WORDS[i]} == -- ]] || continue
    if declare -F _command_offset >/dev/null; then
      _command_offset $((i + 1))
    elif ((COMP_CWORD == i + 1)) && [[ $cur != */* ]]; then
      mapfile -t COMPREPLY < <(compgen -c -- "$cur" | sort -u)
    else
      compopt -o filenames 2>/dev/null
      mapfile -t COMPREPLY < <(compgen -f -- "$cur")
    fi
    return 0
  done
  _shtab_conch "$@"
}

complete -o bashdefault -F _conch_complete conch
"""
SHTAB_BASH_COMPLETE = "complete -o bashdefault -F _shtab_conch conch"
# _normal completes the words after -- as a command line of their own.
ZSH_NAME = '  ":semaphore name (1-200 bytes of UTF-8):"\n'
ZSH_COMMAND = ZSH_NAME + '  "*::command:_normal"\n'


def script(shell: str) -> str:
    text = shtab.complete(parser, shell=shell).rstrip("\n") + "\n"
    if shell == "bash":
        assert text.count(SHTAB_BASH_COMPLETE) == 1, "shtab's bash output changed"
        text = text.replace(SHTAB_BASH_COMPLETE + "\n", BASH_COMMAND.lstrip("\n"))
    elif shell == "zsh":
        assert text.count(ZSH_NAME) == 1, "shtab's zsh output changed"
        text = text.replace(ZSH_NAME, ZSH_COMMAND)
    return text


out = Path(sys.argv[1])
for shell, path in (("bash", "bash/conch"), ("zsh", "zsh/_conch"), ("fish", "fish/conch.fish")):
    (out / path).parent.mkdir(parents=True, exist_ok=True)
    (out / path).write_text(script(shell))
PY
}
if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    if ! diff -ru completions "$tmp"; then
        echo "gen_completions: completions/ is stale; run scripts/gen_completions.sh and commit" >&2
        exit 1
    fi
    echo "gen_completions: completions/ is current"
else
    generate completions
fi
