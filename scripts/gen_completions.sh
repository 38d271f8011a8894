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
for sub in commands.choices.values():
    for action in sub._actions:
        if action.dest in ("cacert", "cert", "key", "password_file"):
            action.complete = shtab.FILE  # file names, not option names
out = Path(sys.argv[1])
for shell, path in (("bash", "bash/conch"), ("zsh", "zsh/_conch"), ("fish", "fish/conch.fish")):
    (out / path).parent.mkdir(parents=True, exist_ok=True)
    (out / path).write_text(shtab.complete(parser, shell=shell).rstrip("\n") + "\n")
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
