#!/usr/bin/env bash
# Installs everything kici-scaler's build and tests need on a Debian 12 machine.
#
# Idempotent: each tool is checked first and installed only when missing, so a
# second run does no network work at all. Run as root (CI and the dev machines
# are root); outside root it uses sudo when available.
#
#   scripts/install-deps.sh            everything (build, tests, fuzz stage)
#   scripts/install-deps.sh --no-fuzz  skip the nightly toolchain and cargo-fuzz
#   scripts/install-deps.sh --fuzz-only only the fuzz tooling (scripts/fuzz.sh uses this)
set -euo pipefail

# Debian packages the build and the tests need. Add here, never install by hand:
# CI runs on a fresh machine that only has what this script installs.
DEBIAN_PACKAGES=(
    build-essential # cc/ld for crates that build C (libfuzzer-sys, ring, ...)
    pkg-config
    musl-tools         # static kici-agent-lite for test images and guests
    postgresql-15      # the PostgreSQL state store (scripts/postgres.sh)
    docker.io          # dockerd for the container backend (scripts/dockerd.sh)
    docker-registry    # a local registry for pull and credential tests
    podman             # the Docker-compatible Podman socket
    nftables           # nft: per-agent egress rules
    iptables           # DOCKER-USER accepts (iptables-nft)
    busybox-static     # test images FROM scratch
    e2fsprogs          # mkfs.ext4 for Firecracker overlay drives
    iproute2           # ip: assertions on links, TAPs and bridges
    qemu-system-x86    # scripts/vm-test.sh: the pure cgroup v2 guest with systemd (TCG)
    qemu-utils         # scripts/vm-test.sh: qemu-img overlays of the cached guest image
    mmdebstrap         # scripts/vm-test.sh: the guest's Debian 12 root filesystem
)

want_base=1
want_fuzz=1
case "${1:-}" in
    "") ;;
    --no-fuzz) want_fuzz=0 ;;
    --fuzz-only) want_base=0 ;;
    *) echo "usage: $0 [--no-fuzz|--fuzz-only]" >&2; exit 64 ;;
esac

log() { printf 'install-deps: %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        log "need root to run: $*"; return 1
    fi
}

install_debian_packages() {
    local missing=() pkg
    for pkg in "${DEBIAN_PACKAGES[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$pkg")
        fi
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "debian packages: all present (${DEBIAN_PACKAGES[*]})"
        return
    fi
    log "debian packages: installing ${missing[*]}"
    # One update per run, and only when something is missing.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

require_rustup() {
    if ! command -v rustup >/dev/null || ! command -v cargo >/dev/null; then
        log "rustup and cargo are required (the machine's Rust toolchain); not found in PATH"
        return 1
    fi
}

install_rust_components() {
    local c missing=()
    cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
    cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
    if [ ${#missing[@]} -gt 0 ]; then
        log "rustup components: adding ${missing[*]}"
        for c in "${missing[@]}"; do rustup component add "$c"; done
    else
        log "rustup components: rustfmt and clippy present"
    fi
}

# The static agent, the Firecracker simulator and fake jailer, and the guest
# binaries are built for this target by the tests themselves
# (kici_testkit::fc::build_binaries, scripts/build-*-musl.sh): a fresh machine
# has only the host target.
MUSL_TARGET=x86_64-unknown-linux-musl
install_rust_targets() {
    if rustup target list --installed | grep -qx "$MUSL_TARGET"; then
        log "rust target $MUSL_TARGET: present"
        return
    fi
    log "rust target $MUSL_TARGET: adding"
    rustup target add "$MUSL_TARGET"
}

install_nextest() {
    if cargo nextest --version >/dev/null 2>&1; then
        log "cargo-nextest: present ($(cargo nextest --version 2>/dev/null | head -n1))"
        return
    fi
    log "cargo-nextest: installing from crates.io"
    cargo install cargo-nextest --locked
}

install_fuzz_tooling() {
    if cargo +nightly --version >/dev/null 2>&1; then
        log "nightly toolchain: present ($(rustc +nightly --version))"
    else
        log "nightly toolchain: installing (minimal profile)"
        rustup toolchain install nightly --profile minimal
    fi
    if cargo +nightly fuzz --version >/dev/null 2>&1; then
        log "cargo-fuzz: present ($(cargo +nightly fuzz --version))"
    else
        log "cargo-fuzz: installing from crates.io"
        cargo install cargo-fuzz --locked
    fi
}

require_rustup
if [ "$want_base" -eq 1 ]; then
    install_debian_packages
    install_rust_components
    install_rust_targets
    install_nextest
fi
if [ "$want_fuzz" -eq 1 ]; then
    install_fuzz_tooling
fi
log "done"
