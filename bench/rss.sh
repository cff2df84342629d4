#!/usr/bin/env bash
# Daemon RSS idle after start and with N (default 200) live stub agents.
# Not run in CI. Usage: bench/rss.sh [N=200]   (see bench/README.md)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
n="${1:-200}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$here/.." && pwd)/target}"
(cd "$here/.." && cargo build --release -q -p kici-scaler -p kici-agent-lite)
exec python3 "$here/harness.py" --bin-dir "$CARGO_TARGET_DIR/release" rss "$n"
