#!/usr/bin/env bash
# Installs everything kici-scaler's build and tests need on a Debian 12 machine.
#
# Idempotent: when every package and command is present a second run does no
# network work at all; otherwise the whole Debian list is installed in one apt
# transaction, and every command the tests call is verified to exist. Run as root (CI and the dev machines
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
    chromium           # the web console's browser tests (headless, DevTools protocol)
    prometheus         # promtool: the shipped alerting rules are checked with it
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

# The commands the build and the tests call, each with the package that
# brings it. After the install every one must exist: a package can be
# installed yet its command gone (apt removed it to resolve a conflict), and
# a test that finds a command missing fails far from the cause.
REQUIRED_COMMANDS=(
    cc:build-essential pkg-config:pkg-config musl-gcc:musl-tools
    psql:postgresql-15 /usr/lib/postgresql/15/bin/initdb:postgresql-15 dockerd:docker.io docker:docker.io
    podman:podman nft:nftables iptables:iptables busybox:busybox-static
    mkfs.ext4:e2fsprogs ip:iproute2 qemu-system-x86_64:qemu-system-x86
    qemu-img:qemu-utils mmdebstrap:mmdebstrap
    chromium:chromium promtool:prometheus
)

# Installs the whole list in one apt transaction, whatever is already present:
# installing packages one by one, or only the "missing" ones, lets apt resolve
# a conflict by removing a package that an earlier check saw installed. The
# case that bit: a machine image carries a newer qemu-utils from backports,
# which Breaks the release's qemu-system-common; asking for qemu-system-x86
# alone made apt remove qemu-utils (and qemu-img with it). qemu-utils is
# therefore asked for from the release itself, downgrades allowed, so that it
# always matches qemu-system-x86.
install_debian_packages() {
    local codename pkgs=() pkg
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")"
    for pkg in "${DEBIAN_PACKAGES[@]}"; do
        case "$pkg" in
            qemu-utils) pkgs+=("qemu-utils/$codename") ;;
            *) pkgs+=("$pkg") ;;
        esac
    done
    if all_commands_present && all_packages_installed; then
        log "debian packages: all present (${DEBIAN_PACKAGES[*]})"
        return
    fi
    log "debian packages: installing ${pkgs[*]} (one transaction)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends --allow-downgrades "${pkgs[@]}"
}

all_packages_installed() {
    local pkg
    for pkg in "${DEBIAN_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || return 1
    done
}

# Commands under /usr/sbin and /sbin count as present for a non-root PATH too.
command_present() {
    command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]
}

all_commands_present() {
    local entry
    for entry in "${REQUIRED_COMMANDS[@]}"; do
        command_present "${entry%%:*}" || return 1
    done
}

# Fails naming every command that is missing and the package it comes from.
verify_commands() {
    local entry missing=()
    for entry in "${REQUIRED_COMMANDS[@]}"; do
        command_present "${entry%%:*}" || missing+=("${entry%%:*} (package ${entry#*:})")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "FAILED: missing after install: ${missing[*]}"
        return 1
    fi
    log "commands: all present (${REQUIRED_COMMANDS[*]%%:*})"
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
    verify_commands
    install_rust_components
    install_rust_targets
    install_nextest
fi
if [ "$want_fuzz" -eq 1 ]; then
    install_fuzz_tooling
fi
log "done"
