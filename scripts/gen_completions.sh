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
# zsh: after --, the words are a command line of their own, completed by _normal (as
# _precommand does for nice, nohup); before it, sema's options as shtab made them.
ZSH_SEMA = "sema) _arguments -C -s $_shtab_conch_sema_options ;;"
ZSH_COMMAND = r"""
_conch_sema() {
  local i
  for ((i = 1; i < CURRENT; i++)); do
    if [[ ${words[i]} == -- ]]; then
      shift $i words
      ((CURRENT -= i))
      _normal
      return
    fi
  done
  _arguments -C -s $_shtab_conch_sema_options
}
"""

# fish: conch's own completions stop at --; after it, the words are a command line of their
# own (__fish_complete_subcommand, as fish's sudo completion uses it).
FISH_USING = "function _shtab_conch_using\n"
FISH_STOP = FISH_USING + "  contains -- -- (commandline -opc); and return 1\n"
FISH_COMMAND = r"""
function _conch_after_dashdash
  contains -- -- (commandline -opc)
end

function _conch_command
  set -l words (commandline -opc) (commandline -ct)
  set -l at (contains -i -- -- $words)
  set -l cmd $words[(math $at + 1)..-1]
  string match -q -- '-*' $cmd[1]; and return  # no command starts with -
  __fish_complete_subcommand --commandline $cmd
end

complete -c conch -n _conch_after_dashdash -f -a '(_conch_command)'
"""


def script(shell: str) -> str:
    text = shtab.complete(parser, shell=shell).rstrip("\n") + "\n"
    if shell == "bash":
        assert text.count(SHTAB_BASH_COMPLETE) == 1, "shtab's bash output changed"
        text = text.replace(SHTAB_BASH_COMPLETE + "\n", BASH_COMMAND.lstrip("\n"))
    elif shell == "zsh":
        assert text.count(ZSH_SEMA) == 1, "shtab's zsh output changed"
        head, _, tail = text.partition("\n_shtab_conch() {")
        text = head + ZSH_COMMAND + "\n_shtab_conch() {" + tail.replace(ZSH_SEMA, "sema) _conch_sema ;;")
    elif shell == "fish":
        assert text.count(FISH_USING) == 1, "shtab's fish output changed"
        text = text.replace(FISH_USING, FISH_STOP) + FISH_COMMAND
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
