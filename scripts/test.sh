#!/usr/bin/env bash
# Run the test suite against real etcd servers it starts itself. Extra args go to pytest.
#
# Tests run side by side on $CONCH_TEST_WORKERS pytest-xdist workers (default 4: on 2 cores
# they mostly wait on etcd), each with its own etcd servers, ports and temp dirs; the tests
# that measure time run with nothing beside them (@pytest.mark.alone, tests/conftest.py).
# --serial: one process, no xdist (for a debugger, -x, -s, or reading output in order).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh"
cd "$root"
parallel=(-n "${CONCH_TEST_WORKERS:-4}" --dist loadgroup)
args=()
for arg in "$@"; do
    if [ "$arg" = --serial ]; then
        parallel=()
    else
        args+=("$arg")
    fi
done
exec .venv/bin/python -m pytest "${parallel[@]}" "${args[@]}"
