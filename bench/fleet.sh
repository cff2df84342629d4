#!/usr/bin/env bash
# A 3-host fleet on loopback against one host, in the same run: scale ->
# exec'd latency, claim throughput, kill -9 failover. Not run in CI.
# Usage: bench/fleet.sh latency [N=100] | throughput [N=2000] | failover [RUNS=10]
#        (see bench/README.md; PROFILE=debug uses the debug build)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
profile="${PROFILE:-release}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
flag=(); [ "$profile" = release ] && flag=(--release)
# memory-backends: the throughput and failover scenarios measure the
# coordination, not thousands of processes.
(cd "$root" && cargo build "${flag[@]}" -q -p kici-scaler --features memory-backends)
"$root/scripts/postgres.sh" start >/dev/null
exec python3 "$here/fleet.py" --bin-dir "$CARGO_TARGET_DIR/$profile" --pg "$("$root/scripts/postgres.sh" url)" "$@"
