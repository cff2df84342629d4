#!/usr/bin/env bash
# Boots a kici guest rootfs under QEMU (software emulation; no KVM needed)
# to prove the guest side on a real kernel: the stock distribution kernel
# and its initramfs mount the rootfs read-only as /dev/vda, our /init (PID 1)
# mounts the API filesystems, stacks the overlay drive /dev/vdb over the
# root and pivots into it, waits for MMDS (there is none here, so it gives
# up after kici.mmds_timeout) and ends the VM with a reboot, which
# `-no-reboot` turns into QEMU exiting. Not part of CI (it takes a minute
# of emulation and needs qemu-system-x86 + linux-image-amd64).
#
#   scripts/qemu-guest-smoke.sh [ROOTFS]     (default: builds one with
#                                             scripts/build-guest-musl.sh)
set -euo pipefail

log() { printf 'qemu-guest-smoke: %s\n' "$*" >&2; }
cd "$(dirname "$0")/.."

command -v qemu-system-x86_64 >/dev/null || { log "needs qemu-system-x86 (apt-get install qemu-system-x86)"; exit 1; }
kernel=$(ls -1 /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1 || true)
[[ -n $kernel ]] && command -v mkinitramfs >/dev/null || { log "needs a kernel in /boot and initramfs-tools (apt-get install linux-image-amd64)"; exit 1; }
version=${kernel#/boot/vmlinuz-}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Distribution kernels build overlayfs as a module (Firecracker's guest
# kernels build it in): an initramfs of our own that loads it.
cp -r /etc/initramfs-tools "$work/initramfs-conf"
echo overlay >> "$work/initramfs-conf/modules"
initrd="$work/initrd.img"
mkinitramfs -d "$work/initramfs-conf" -o "$initrd" "$version"
rootfs=${1:-}
if [[ -z $rootfs ]]; then
    rootfs="$work/rootfs.ext4"
    scripts/build-guest-musl.sh --rootfs "$rootfs" >/dev/null
fi
overlay="$work/overlay.ext4"
truncate -s 256M "$overlay"
mkfs.ext4 -q -F "$overlay"
serial="$work/serial.log"

log "booting $kernel with $rootfs"
start=$(date +%s)
timeout 600 qemu-system-x86_64 -m 512 -smp 1 -display none -no-reboot \
    -serial "file:$serial" \
    -kernel "$kernel" -initrd "$initrd" \
    -append "console=ttyS0 root=/dev/vda ro init=/init panic=-1 kici.mmds_timeout=5" \
    -drive "file=$rootfs,format=raw,if=virtio,readonly=on" \
    -drive "file=$overlay,format=raw,if=virtio" || true
log "QEMU exited after $(( $(date +%s) - start )) s"

fail=0
expect() {
    if grep -qF -- "$1" "$serial"; then log "ok: $1"; else log "MISSING: $1"; fail=1; fi
}
expect "kici-init: root is writable: overlay on /dev/vdb"
expect "kici-init: waiting for the MMDS bootstrap at 169.254.169.254:80"
expect "kici-init: no bootstrap: MMDS at 169.254.169.254:80 had no bootstrap within 5s"
expect "reboot: Restarting system"
if grep -q "Kernel panic" "$serial"; then log "kernel panic"; fail=1; fi
if [[ $fail != 0 ]]; then
    log "serial console:"; tail -n 60 "$serial" >&2
    exit 1
fi
log "guest booted to /init, overlaid /dev/vdb, waited for MMDS and ended the VM"
