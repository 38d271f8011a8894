#!/usr/bin/env bash
# Run the test suite against real etcd servers it starts itself. Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
