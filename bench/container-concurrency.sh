#!/usr/bin/env bash
# 20 container spawns one after another vs 20 at once, POST /v1/scale ->
# container State.Running (dockerd's start event), through `kici-scaler
# serve` on the real dockerd (scripts/dockerd.sh start). Prints both totals
# and their ratio. Not run in CI.
# Usage: bench/container-concurrency.sh [N=20]   (see bench/README.md)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
n="${1:-20}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$here/.." && pwd)/target}"
(cd "$here/.." && cargo build --release -q -p kici-scaler)
exec python3 "$here/harness.py" --bin-dir "$CARGO_TARGET_DIR/release" container-concurrency "$n"
