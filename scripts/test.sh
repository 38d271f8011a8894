#!/usr/bin/env bash
# Run the test suite against real etcd servers it starts itself. Extra args (-k, -x, paths,
# ...) go to pytest.
#
# The tests run side by side on $CONCH_TEST_WORKERS pytest-xdist workers (default 4: on
# 2 cores they mostly wait on etcd), each worker with its own etcd servers, ports and temp
# dirs; then the few that measure time (@pytest.mark.alone) run in one process with nothing
# beside them. --serial: all of them in one process, no xdist (for pdb, -s, output in order).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh"
cd "$root"
serial=0
args=()
for arg in "$@"; do
    if [ "$arg" = --serial ]; then
        serial=1
    else
        args+=("$arg")
    fi
done
pytest=(.venv/bin/python -m pytest)
if [ "$serial" = 1 ]; then
    exec "${pytest[@]}" "${args[@]}"
fi
# exit 5: no test selected in that phase (-k or a path chose none of its tests)
shared=0
# --durations: the slowest tests, so that the suite's time shows where it goes
"${pytest[@]}" -n "${CONCH_TEST_WORKERS:-4}" --dist loadgroup --phase shared --durations=10 \
    "${args[@]}" || shared=$?
echo "== the tests that measure time, one at a time with nothing beside them"
alone=0
"${pytest[@]}" --phase alone --durations=5 "${args[@]}" || alone=$?
if [ "$shared" = 5 ] && [ "$alone" = 5 ]; then
    exit 5
fi
for code in "$shared" "$alone"; do
    if [ "$code" != 0 ] && [ "$code" != 5 ]; then
        exit "$code"
    fi
done
