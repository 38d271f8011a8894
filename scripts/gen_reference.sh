#!/usr/bin/env bash
# Make docs/reference/ (the embedding reference: every public name of conch, conch.aio,
# conch.events and conch.otel, from their docstrings) with pdoc.
#   scripts/gen_reference.sh           write docs/reference/
#   scripts/gen_reference.sh --check   fail if docs/reference/ is not what the code gives now
# Only the public modules are documented: the internals behind them (conch/core, conch/etcd)
# may move without the page changing, unless what a caller sees changes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
cd "$root"
modules=(conch conch.aio conch.events conch.otel)
generate() {
    rm -rf "$1"
    "$python" -m pdoc --no-search --no-show-source --docformat markdown \
        --template-directory scripts/reference --footer-text "conch $("$python" -c 'import conch; print(conch.__version__)')" \
        -o "$1" "${modules[@]}" 2> >(grep -v '^Warn: Error parsing type annotation' >&2)
}
if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp/reference"
    if ! diff -ru docs/reference "$tmp/reference"; then
        echo "gen_reference: docs/reference/ is stale; run scripts/gen_reference.sh and commit" >&2
        exit 1
    fi
    echo "gen_reference: docs/reference/ is current"
else
    generate docs/reference
fi
