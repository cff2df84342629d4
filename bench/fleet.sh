#!/usr/bin/env bash
# A fleet on loopback against one host, in the same run: scale -> exec'd
# latency, claim throughput, kill -9 failover; the fleet at scale (1 to 50
# hosts on a stock PostgreSQL); chaos. Not run in CI.
# Usage: bench/fleet.sh latency [N=100] | throughput [N=2000] | failover [RUNS=10]
#        bench/fleet.sh scale [--hosts 1,3,10,25,50] [-n 1000] [--quick] ...
#        bench/fleet.sh chaos [SECONDS=600]
#        (see bench/README.md; PROFILE=debug uses the debug build)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
profile="${PROFILE:-release}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
if [ "${1:-}" = chaos ]; then
    # The CI test fleet_chaos, its fault sequence repeated: one round
    # (kill -9, SIGTERM, a database restart, a partition, kill -9 with the
    # agents surviving) takes about 40 s.
    seconds="${2:-600}"
    rounds=$(( (seconds + 39) / 40 ))
    # The test runs its own PostgreSQL (port 54353), which it restarts.
    cd "$root"
    exec env KICI_SCALER_CHAOS_ROUNDS="$rounds" cargo test -q -p kici-scaler --test it -- \
        --exact fleet_chaos::serial_fleet_chaos_kill_restart_database_restart_and_partition_keep_the_invariants \
        --nocapture
fi
flag=(); [ "$profile" = release ] && flag=(--release)
# memory-backends: the throughput, failover and scale scenarios measure the
# coordination, not thousands of processes.
(cd "$root" && cargo build "${flag[@]}" -q -p kici-scaler --features memory-backends)
"$root/scripts/postgres.sh" start >/dev/null
exec python3 "$here/fleet.py" --bin-dir "$CARGO_TARGET_DIR/$profile" --pg "$("$root/scripts/postgres.sh" url)" "$@"
