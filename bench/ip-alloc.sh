#!/usr/bin/env bash
# IP allocations per second vs raw single-row INSERT transactions per second
# on PostgreSQL (fsync and synchronous_commit on) and on SQLite,
# with 16 concurrent allocators. See bench/README.md.
#
#   bench/ip-alloc.sh [SECONDS_PER_PHASE=3] [extra args for the bench binary]
#
# Starts the throwaway PostgreSQL (scripts/postgres.sh) unless
# KICI_SCALER_TEST_POSTGRES names a server; the bench creates and drops a
# scratch database there.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
seconds="${1:-3}"
shift || true

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
if [ -z "${KICI_SCALER_TEST_POSTGRES:-}" ]; then
    scripts/postgres.sh start
    KICI_SCALER_TEST_POSTGRES="$(scripts/postgres.sh url)"
    export KICI_SCALER_TEST_POSTGRES
fi

cargo bench -q -p kici-store --bench ip_alloc -- --seconds "$seconds" --concurrency 16 "$@"
