#!/usr/bin/env bash
# Regenerate generated/ from protos/ with grpcio-tools.
#   scripts/gen_protos.sh           write generated/conchpb
#   scripts/gen_protos.sh --check   fail if generated/ differs from what protos/ gives
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

generate() {  # $1: output folder
    local out=$1
    mkdir -p "$out"
    (cd "$root/protos" && find conchpb -name '*.proto' | LC_ALL=C sort) | while read -r proto; do
        "$python" -m grpc_tools.protoc -I "$root/protos" \
            --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$proto"
    done
    # Our messages live in a descriptor pool of their own, not protobuf's default
    # pool, so that another etcd client's stubs (same message names) can be
    # loaded in the same process in either order.
    find "$out" -name '*_pb2.py' -print0 | xargs -0 sed -i \
        -e 's/^from google\.protobuf import descriptor_pool as _descriptor_pool$/from conchpb import _pool/' \
        -e 's/_descriptor_pool\.Default()/_pool.POOL/'
    for d in "$out"/conchpb "$out"/conchpb/*/; do
        [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
    done
    cat > "$out/conchpb/_pool.py" <<'PY'
"""The descriptor pool that holds conch's etcd API messages (kept apart from the default pool)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
PY
}

if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    if ! diff -r -x __pycache__ "$tmp/conchpb" "$root/generated/conchpb"; then
        echo "gen_protos: generated/ is stale; run scripts/gen_protos.sh and commit" >&2
        exit 1
    fi
    echo "gen_protos: generated/ is current"
else
    rm -rf "$root/generated/conchpb"
    generate "$root/generated"
fi
