#!/usr/bin/env bash
# Builds the Firecracker guest side as static x86_64 musl binaries —
# kici-agent-lite and kici-guest-init (/init) — checks that both are static,
# and, with --rootfs FILE, writes a guest rootfs image with them and
# busybox-static (`kici-scaler firecracker rootfs`, which needs mkfs.ext4 and
# debugfs from e2fsprogs).
#
#   scripts/build-guest-musl.sh                     print the two paths
#   scripts/build-guest-musl.sh --rootfs out.ext4 [--size-mib N] [--busybox PATH]
#
# Needs only rustup for the binaries (the musl target ships its own C
# runtime). Honours CARGO_TARGET_DIR.
set -euo pipefail

TARGET=x86_64-unknown-linux-musl
rootfs=""
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rootfs) rootfs="${2:?--rootfs needs a file}"; shift 2 ;;
        --size-mib|--busybox) extra+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        *) echo "usage: $0 [--rootfs FILE [--size-mib N] [--busybox PATH]]" >&2; exit 64 ;;
    esac
done

log() { printf 'build-guest-musl: %s\n' "$*" >&2; }

cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx "$TARGET"; then
    log "adding rust target $TARGET"
    rustup target add "$TARGET"
fi

cargo build -p kici-agent-lite -p kici-guest-init --bins --release --target "$TARGET"

target_dir="${CARGO_TARGET_DIR:-target}"
agent="$target_dir/$TARGET/release/kici-agent-lite"
init="$target_dir/$TARGET/release/kici-guest-init"
for bin in "$agent" "$init"; do
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
    log "static: $bin ($(stat -c %s "$bin") bytes)"
done

if [[ -n $rootfs ]]; then
    cargo build -p kici-scaler --release
    "$target_dir/release/kici-scaler" firecracker rootfs --out "$rootfs" \
        --agent "$agent" --init "$init" "${extra[@]}"
    echo "$rootfs"
else
    echo "$agent"
    echo "$init"
fi
