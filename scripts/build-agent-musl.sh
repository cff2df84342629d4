#!/usr/bin/env bash
# Builds kici-agent-lite as a static x86_64 musl binary (for container images
# built FROM scratch and Firecracker rootfs images), checks that it is static
# and runs, and prints its path.
#
#   scripts/build-agent-musl.sh            release build
#   scripts/build-agent-musl.sh --strip    also write a stripped copy beside it
#
# Needs only rustup (the musl target ships its own C runtime; the agent has no
# C dependencies). Honours CARGO_TARGET_DIR.
set -euo pipefail

TARGET=x86_64-unknown-linux-musl
strip=0
case "${1:-}" in
    "") ;;
    --strip) strip=1 ;;
    *) echo "usage: $0 [--strip]" >&2; exit 64 ;;
esac

log() { printf 'build-agent-musl: %s\n' "$*" >&2; }

cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx "$TARGET"; then
    log "adding rust target $TARGET"
    rustup target add "$TARGET"
fi

cargo build -p kici-agent-lite --release --target "$TARGET"

target_dir="${CARGO_TARGET_DIR:-target}"
bin="$target_dir/$TARGET/release/kici-agent-lite"
[[ -x "$bin" ]] || { log "no binary at $bin"; exit 1; }

# A static binary has no program interpreter (PT_INTERP) and no NEEDED libraries.
if command -v readelf >/dev/null; then
    if readelf -l "$bin" | grep -q 'Requesting program interpreter'; then
        log "$bin is dynamically linked"; exit 1
    fi
    if readelf -d "$bin" 2>/dev/null | grep -q '(NEEDED)'; then
        log "$bin needs shared libraries"; exit 1
    fi
fi
"$bin" --version >/dev/null

if [[ $strip == 1 ]]; then
    cp "$bin" "$bin.stripped"
    strip "$bin.stripped"
    bin="$bin.stripped"
fi
log "static agent: $bin ($(stat -c %s "$bin") bytes)"
echo "$bin"
