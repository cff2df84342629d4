#!/usr/bin/env bash
# POST /v1/scale -> agent exec'd, N spawns via `kici-scaler serve` against the
# same stub spawned directly by the harness, in the same run. Not run in CI.
# Usage: bench/spawn-latency.sh [N=200]   (see bench/README.md)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
n="${1:-200}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$here/.." && pwd)/target}"
(cd "$here/.." && cargo build --release -q -p kici-scaler -p kici-agent-lite)
exec python3 "$here/harness.py" --bin-dir "$CARGO_TARGET_DIR/release" spawn-latency "$n"
