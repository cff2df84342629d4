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
# With --mmds (needs python3) it boots with networking instead: QEMU's
# user network forwards the guest's 10.0.2.100:80 (one `busybox nc` per
# connection) to an MMDS V2 stand-in on the host (token session, 401
# without a token), whose
# document points the agent at a listener on the host (10.0.2.2); the run
# passes when the agent, started by /init with the MMDS bootstrap, opens
# its WebSocket there (`GET /ws`).
#
#   scripts/qemu-guest-smoke.sh [--mmds] [ROOTFS]   (default: builds one with
#                                                    scripts/build-guest-musl.sh)
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
mmds=0
if [[ ${1:-} == --mmds ]]; then mmds=1; shift; fi
rootfs=${1:-}
if [[ -z $rootfs ]]; then
    rootfs="$work/rootfs.ext4"
    scripts/build-guest-musl.sh --rootfs "$rootfs" >/dev/null
fi
overlay="$work/overlay.ext4"
truncate -s 256M "$overlay"
mkfs.ext4 -q -F "$overlay"
serial="$work/serial.log"

expect() {
    if grep -qF -- "$1" "$serial"; then log "ok: $1"; else log "MISSING: $1"; fail=1; fi
}

if [[ $mmds == 0 ]]; then
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
exit 0
fi

# The distribution initramfs configures `ip=` only for NFS roots: a
# local-bottom script of our own does it (Firecracker's kernels do it
# themselves, with the NIC driver built in).
mkdir -p "$work/initramfs-conf/scripts/local-bottom"
cat > "$work/initramfs-conf/scripts/local-bottom/kici-net" <<'NET'
#!/bin/sh
[ "$1" = prereqs ] && exit 0
. /scripts/functions
configure_networking
NET
chmod +x "$work/initramfs-conf/scripts/local-bottom/kici-net"
mkinitramfs -d "$work/initramfs-conf" -o "$initrd" "$version"

cat > "$work/stand-in.py" <<'PY'
import http.server, json, secrets, socket, sys, threading
gateway = socket.socket(); gateway.bind(("127.0.0.1", 0)); gateway.listen(1)
gw_port = gateway.getsockname()[1]
doc = {"kici-orchestrator-url": f"ws://10.0.2.2:{gw_port}/ws",
       "kici-agent-id": "scaler-firecracker-0a1b2c3d",
       "kici-labels": "linux,kici:agent:firecracker", "kici-scaler-managed": "1",
       "kici-gateway-ip": "10.0.2.2", "kici-env": {"KICI_SCALER_IDLE_TIMEOUT": "0"}}
tokens = set()
class Mmds(http.server.BaseHTTPRequestHandler):
    def answer(self, status, body, ctype="text/plain"):
        data = body.encode(); self.send_response(status)
        self.send_header("Content-Type", ctype); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_PUT(self):
        if self.path != "/latest/api/token" or not self.headers.get("X-metadata-token-ttl-seconds"):
            return self.answer(400, "bad token request")
        t = secrets.token_hex(16); tokens.add(t); self.answer(200, t)
    def do_GET(self):
        if self.headers.get("X-metadata-token") not in tokens:
            return self.answer(401, "MMDS token not valid.")
        if self.path.rstrip("/") != "/latest/meta-data":
            return self.answer(404, "not found")
        self.answer(200, json.dumps(doc), "application/json")
    def log_message(self, *a): print("mmds:", self.command, self.path, a[1], flush=True)
mmds = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Mmds)
threading.Thread(target=mmds.serve_forever, daemon=True).start()
print(mmds.server_address[1], flush=True)
conn, _ = gateway.accept()
print("gateway:", conn.recv(4096).decode(errors="replace").splitlines()[0], flush=True)
PY
coproc STANDIN { exec python3 -u "$work/stand-in.py" > "$work/stand-in.log" 2>&1; }
for _ in $(seq 50); do [[ -s "$work/stand-in.log" ]] && break; sleep 0.1; done
mmds_port=$(head -1 "$work/stand-in.log")
log "MMDS stand-in on 127.0.0.1:$mmds_port; booting with networking"
start=$(date +%s)
: > "$serial"
timeout 600 qemu-system-x86_64 -m 512 -smp 1 -display none -no-reboot \
    -serial "file:$serial" \
    -kernel "$kernel" -initrd "$initrd" \
    -append "console=ttyS0 root=/dev/vda ro init=/init panic=-1 net.ifnames=0 ip=10.0.2.15::10.0.2.2:255.255.255.0::eth0:off kici.mmds=10.0.2.100:80 kici.mmds_timeout=60" \
    -netdev "user,id=n0,guestfwd=tcp:10.0.2.100:80-cmd:busybox nc 127.0.0.1 $mmds_port" -device e1000,netdev=n0 \
    -drive "file=$rootfs,format=raw,if=virtio,readonly=on" \
    -drive "file=$overlay,format=raw,if=virtio" &
qemu=$!
# Done when the agent reaches the gateway (the stand-in exits) or the VM ends.
while kill -0 "$qemu" 2>/dev/null && ! grep -q "^gateway: " "$work/stand-in.log"; do sleep 0.5; done
log "stopping after $(( $(date +%s) - start )) s"
kill "$qemu" 2>/dev/null || true
wait "$qemu" 2>/dev/null || true
kill "${STANDIN_PID:-}" 2>/dev/null || true
fail=0
expect "kici-init: started /usr/local/bin/kici-agent-lite"
expect "as scaler-firecracker-0a1b2c3d"
if grep -q "^gateway: GET /ws" "$work/stand-in.log"; then log "ok: the agent opened its WebSocket"; else log "MISSING: the agent's WebSocket"; fail=1; fi
if [[ $fail != 0 ]]; then
    log "stand-in:"; cat "$work/stand-in.log" >&2
    log "serial console:"; tail -n 60 "$serial" >&2
    exit 1
fi
log "the agent took its bootstrap from MMDS V2 and reached its gateway"
