#!/usr/bin/env bash
# Make man/conch.1 from the real argparse parser (argparse-manpage) plus man/conch.include.
#   scripts/gen_manpage.sh           write man/conch.1
#   scripts/gen_manpage.sh --check   fail if man/conch.1 is not what the parser gives now
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
cd "$root"
version=$("$python" -c 'import conch; print(conch.__version__)')
# A fixed date, so the page only changes when the parser or the include does.
export SOURCE_DATE_EPOCH=1798675200  # 2027-01-01
generate() {
    "$python" -c "import sys; from argparse_manpage.cli import main; sys.argv[0] = 'argparse-manpage'; sys.exit(main())" --module conch.cli --function build_parser --prog conch \
        --project-name conch --version "$version" --manual-title "conch manual" \
        --description "flock(1) for a whole cluster, on etcd v3" \
        --include man/conch.include --output "$1"
}
if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp)
    trap 'rm -f "$tmp"' EXIT
    generate "$tmp"
    if ! diff -u man/conch.1 "$tmp"; then
        echo "gen_manpage: man/conch.1 is stale; run scripts/gen_manpage.sh and commit" >&2
        exit 1
    fi
    echo "gen_manpage: man/conch.1 is current"
else
    generate man/conch.1
fi
