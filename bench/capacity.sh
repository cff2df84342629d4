#!/usr/bin/env bash
# Capacity planning benchmark: replays bench/traces/{diurnal,fanout}.jsonl
# with `kici-scaler simulate` under no warm pool, every static pool size
# 0..maxAgents, a hand-written schedule and the forecast; prints the
# (wait p90, idle agent-seconds) table per trace with the Pareto frontier
# marked, and writes bench/capacity-<trace>.svg. See bench/README.md.
#
# Usage: bench/capacity.sh [OUT_DIR]   (default: bench/)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
target="${CARGO_TARGET_DIR:-$here/../target}"
cargo build --release --bin kici-scaler --manifest-path "$here/../Cargo.toml" >&2
[ -s "$here/traces/diurnal.jsonl" ] || python3 "$here/traces/generate.py"
exec python3 "$here/capacity.py" "$target/release/kici-scaler" "$out"
