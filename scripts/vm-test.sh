#!/usr/bin/env bash
# The packaged service on a real pure-cgroup-v2 host with real systemd.
#
# Builds the Debian package (scripts/package.sh), boots a Debian 12 guest
# under QEMU (software emulation: no KVM needed) with the distribution kernel
# and systemd.unified_cgroup_hierarchy=1, installs the package with dpkg -i,
# starts kici-scaler.service and checks, from this host:
#
#   1. the guest is pure cgroup v2 under systemd; the service runs in its
#      delegated cgroup's daemon/ leaf; doctor prints the right case for the
#      service (delegated), a shell's undelegated unit, and --cgroup-root;
#   2. a bare-metal job end to end with `kici-scaler run --server` through a
#      forwarded port, its agent in <unit>/agents/<instance>/<scaler>/<agent>;
#   3. cpu.max, pids.max, memory.max, memory.swap.max, memory.oom.group in
#      the agent's cgroup;
#   4. a memory-limited agent OOM-killed by the kernel (the kernel log's
#      oom-kill line names its cgroup) while the daemon and another agent
#      live on;
#   5. systemctl reload (SIGHUP, same main pid);
#   6. systemctl stop with an agent running: no agent process, no agent
#      cgroup left;
#   7. systemctl kill -s KILL with an agent running, then start: the new
#      daemon recovers (the dead agent recorded gone, nothing left over) and
#      runs jobs again;
#   8. an unprivileged user's `kici-scaler run` in a delegated user scope;
#   9. an unprivileged user in the `docker` group runs a job in a container
#      (the system dockerd, the test image loaded from this host; no
#      registry): network isolation on is refused with the reason, off runs
#      the job and leaves no container.
#
# The guest's root filesystem is built with mmdebstrap from Debian's
# packages and cached in $KICI_VM_CACHE (default /var/cache/kici-scaler-vm),
# keyed by a hash of its recipe (this script's rootfs section): a changed
# recipe builds a new one, --rebuild forces it, deleting the directory is
# always safe. Each run boots a copy-on-write overlay of it, so runs never
# see each other's state.
#
# Control: QEMU's user network forwards 127.0.0.1:<port> to the guest's
# control API (0.0.0.0:7878, bearer token); a virtio-serial port carries
# shell scripts to a runner in the guest and their output back; a read-only
# 9p share carries the package. Nothing listens beyond loopback.
#
#   scripts/vm-test.sh [--rebuild] [--profile dev|release] [--deb FILE] [--rootfs-only]
#
# --deb uses that package instead of building one; --rootfs-only builds (or
# finds) the cached guest image and stops.
#
# Needs root (mmdebstrap --mode=root) and qemu-system-x86, mmdebstrap,
# e2fsprogs, qemu-utils (scripts/install-deps.sh installs them).
set -euo pipefail

log() { printf 'vm-test: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
cd "$(dirname "$0")/.."
repo=$(pwd)

rebuild=0
profile=release
deb=""
rootfs_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rebuild) rebuild=1 ;;
        --profile) profile="${2:?--profile needs dev or release}"; shift ;;
        --deb) deb="${2:?--deb needs a file}"; shift ;;
        --rootfs-only) rootfs_only=1 ;;
        *) echo "usage: $0 [--rebuild] [--profile dev|release] [--deb FILE] [--rootfs-only]" >&2; exit 64 ;;
    esac
    shift
done

for tool in qemu-system-x86_64 qemu-img mmdebstrap mkfs.ext4; do
    command -v "$tool" >/dev/null || die "$tool missing (scripts/install-deps.sh installs it)"
done
[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap --mode=root builds the guest's root filesystem)"

started=$(date +%s)
elapsed() { echo "$(($(date +%s) - started)) s"; }

# ------------------------------------------------------------------ rootfs
cache="${KICI_VM_CACHE:-/var/cache/kici-scaler-vm}"
mkdir -p "$cache"
work=$(mktemp -d "${TMPDIR:-/tmp}/kici-vm-test.XXXXXX")
qemu_pid=""
cleanup() {
    if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
        kill "$qemu_pid" 2>/dev/null || true
        wait "$qemu_pid" 2>/dev/null || true
    fi
    exec 3>&- 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

GUEST_PACKAGES=systemd-sysv,udev,linux-image-amd64,dbus,dbus-user-session,libpam-systemd,procps,kmod,iproute2,attr,docker.io,apparmor

# Runs inside mmdebstrap's customize hook with the root directory as $1.
cat >"$work/customize.sh" <<'CUSTOMIZE'
#!/bin/sh
set -eu
root="$1"
echo kici-vm >"$root/etc/hostname"
printf '/dev/vda / ext4 rw,discard 0 1\n' >"$root/etc/fstab"
# DHCP from QEMU's user network, so the forwarded port reaches the guest.
mkdir -p "$root/etc/systemd/network"
printf '[Match]\nName=en*\n\n[Network]\nDHCP=yes\n' >"$root/etc/systemd/network/20-wired.network"
echo 9p >"$root/etc/modules-load.d/kici-9p.conf"
echo 9pnet_virtio >>"$root/etc/modules-load.d/kici-9p.conf"
mkdir -p "$root/mnt/kici"
# The runner: each line from the host is "<id> <base64 script>"; the
# script's output goes back, then "__KICI_RC__ <id> <exit code>".
cat >"$root/usr/local/sbin/kici-vm-runner" <<'RUNNER'
#!/bin/bash
port=/dev/virtio-ports/kici.cmd
exec 3<>"$port"
while IFS=' ' read -r id script <&3; do
    printf '%s' "$script" | base64 -d >/run/kici-vm-cmd.sh
    out=$(bash /run/kici-vm-cmd.sh 2>&1 </dev/null)
    rc=$?
    printf '%s\n__KICI_RC__ %s %s\n' "$out" "$id" "$rc" >&3
done
RUNNER
chmod 755 "$root/usr/local/sbin/kici-vm-runner"
cat >"$root/etc/systemd/system/kici-vm-runner.service" <<'UNIT'
[Unit]
Description=runs the vm-test host's scripts (virtio-serial)
[Service]
ExecStart=/usr/local/sbin/kici-vm-runner
Restart=always
[Install]
WantedBy=multi-user.target
UNIT
chroot "$root" systemctl enable systemd-networkd kici-vm-runner.service
# Boots faster and quieter under emulation.
chroot "$root" systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer man-db.timer
# An unprivileged user whose systemd --user runs from boot (lingering).
chroot "$root" useradd --create-home --uid 1000 --shell /bin/bash kici
# Docker's group: what an unprivileged user needs for container scalers.
# dockerd starts only for the check that uses it (under emulation it would
# slow every boot).
chroot "$root" usermod -aG docker kici
chroot "$root" systemctl disable docker.service docker.socket containerd.service
mkdir -p "$root/var/lib/systemd/linger"
touch "$root/var/lib/systemd/linger/kici"
rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
CUSTOMIZE
chmod 755 "$work/customize.sh"

MIRROR="${KICI_VM_MIRROR:-http://deb.debian.org/debian}"
recipe_key=$(cat "$work/customize.sh" <(echo "$GUEST_PACKAGES bookworm v1") | sha256sum | cut -c1-16)
image_dir="$cache/rootfs-$recipe_key"
if [ "$rebuild" -eq 1 ] || [ ! -f "$image_dir/done" ]; then
    log "building the guest's root filesystem (mmdebstrap, Debian 12; cache $image_dir)"
    rm -rf "$cache"/rootfs-* "$cache"/build-*
    build="$cache/build-$recipe_key"
    mkdir -p "$build"
    mmdebstrap --mode=root --variant=apt --include="$GUEST_PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook="$work/customize.sh \"\$1\"" \
        bookworm "$build/root" "$MIRROR" >"$build/mmdebstrap.log" 2>&1 \
        || { tail -n 30 "$build/mmdebstrap.log" >&2; die "mmdebstrap failed (log above)"; }
    mkdir -p "$build/out"
    cp "$(ls -1 "$build"/root/boot/vmlinuz-* | sort -V | tail -n 1)" "$build/out/vmlinuz"
    cp "$(ls -1 "$build"/root/boot/initrd.img-* | sort -V | tail -n 1)" "$build/out/initrd.img"
    mkfs.ext4 -q -F -L root -d "$build/root" "$build/out/rootfs.img" 3G
    rm -rf "$build/root"
    mv "$build/out" "$image_dir"
    touch "$image_dir/done"
    rm -rf "$build"
    log "root filesystem built ($(elapsed))"
else
    log "root filesystem from the cache: $image_dir"
fi

if [ "$rootfs_only" -eq 1 ]; then exit 0; fi

# ------------------------------------------------------------------ package
if [ -z "$deb" ]; then
    log "building the package (profile $profile)"
    deb=$(scripts/package.sh --profile "$profile" | tail -n 1)
fi
[ -f "$deb" ] || die "no package at ${deb:-?} (scripts/package.sh builds one)"
# The host's CLI: the one the package was built with.
host_cli="$(dirname "$(dirname "$deb")")/package/bin/kici-scaler"
[ -x "$host_cli" ] || die "no $host_cli beside the package (scripts/package.sh puts it there)"
log "package: $deb ($(elapsed))"

# ------------------------------------------------------------------ boot
free_port() {
    local p
    for _ in $(seq 50); do
        p=$((20000 + RANDOM % 20000))
        if ! (exec 9<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
    done
    die "no free port"
}
api_port=$(free_port)
cmd_port=$(free_port)
mkdir -p "$work/share"
cp "$deb" "$work/share/kici-scaler.deb"
cp examples/quickstart.yaml "$work/share/quickstart.yaml"
# The container test image (static agent + busybox, FROM scratch), built by
# this host's dockerd and loaded into the guest's: nothing is pulled.
log "building the container test image"
scripts/dockerd.sh start >&2
test_image=$(scripts/build-test-image.sh kici-agent-lite:vm-test | tail -n 1)
docker save -o "$work/share/agent-image.tar" "$test_image"
qemu-img create -q -f qcow2 -b "$image_dir/rootfs.img" -F raw "$work/disk.qcow2"
log "booting the guest (TCG, 2 vCPUs, 2 GiB; control API on 127.0.0.1:$api_port)"
qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max -smp 2 -m 2048 \
    -display none -no-reboot -serial "file:$work/serial.log" \
    -kernel "$image_dir/vmlinuz" -initrd "$image_dir/initrd.img" \
    -append "console=ttyS0 root=/dev/vda rw systemd.unified_cgroup_hierarchy=1 panic=-1 quiet" \
    -drive "file=$work/disk.qcow2,if=virtio,format=qcow2" \
    -netdev "user,id=n0,hostfwd=tcp:127.0.0.1:$api_port-:7878" -device virtio-net-pci,netdev=n0 \
    -device virtio-serial-pci \
    -chardev "socket,id=cmd,host=127.0.0.1,port=$cmd_port,server=on,wait=off" \
    -device virtserialport,chardev=cmd,name=kici.cmd \
    -virtfs "local,path=$work/share,mount_tag=kici,security_model=none,readonly=on" \
    >"$work/qemu.log" 2>&1 &
qemu_pid=$!

for _ in $(seq 100); do
    if { exec 3<>"/dev/tcp/127.0.0.1/$cmd_port"; } 2>/dev/null; then break; fi
    kill -0 "$qemu_pid" 2>/dev/null || { cat "$work/qemu.log" >&2; die "QEMU exited"; }
    sleep 0.2
done

# Every guest script starts with this: `none CMD…` fails when CMD succeeds
# (a bare `! CMD` does not stop a `set -e` script), and the API token is in
# the environment once the package's /etc/default/kici-scaler has it.
GUEST_PRELUDE='none() { if "$@"; then echo "unexpected: $*"; return 1; fi; }
if [ -r /etc/default/kici-scaler ]; then set -a; . /etc/default/kici-scaler; set +a; fi'

# vm SCRIPT [TIMEOUT]: runs SCRIPT with bash in the guest; prints its output
# (stdout and stderr); returns its exit code.
vm() {
    local script="$1" limit="${2:-300}" id line
    id="$RANDOM$RANDOM"
    script="$GUEST_PRELUDE
$script"
    printf '%s %s\n' "$id" "$(printf '%s' "$script" | base64 -w0)" >&3
    while IFS= read -r -t "$limit" line <&3; do
        if [[ $line == "__KICI_RC__ $id "* ]]; then return "${line##* }"; fi
        printf '%s\n' "$line"
    done
    log "no answer from the guest within ${limit}s; serial console:"
    tail -n 40 "$work/serial.log" >&2
    return 124
}
# check NAME SCRIPT: vm SCRIPT, output indented, fails the run if it fails.
check() {
    local name="$1" script="$2" rc=0
    log "--- $name"
    vm "$script" "${3:-300}" | sed 's/^/    /' || rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || die "$name (exit $rc)"
}

# The first answer comes once the guest has booted and started the runner.
vm 'systemctl is-system-running --wait >/dev/null; echo booted' 600 >/dev/null \
    || die "the guest did not boot (serial console above)"
log "guest up ($(elapsed))"

# The highest exposure `systemd-analyze security` may give the packaged unit
# (docs/security.md explains each exposure that remains).
MAX_EXPOSURE=3.3

token="vmtest-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export KICI_SCALER_API_TOKEN="$token"
server="http://127.0.0.1:$api_port"
host_run() { timeout 300 "$host_cli" run --server "$server" "$@"; }

# ------------------------------------------------------------------ checks
check "pure cgroup v2 under systemd" '
set -e
echo "kernel $(uname -r); $(systemctl --version | head -n 1)"
echo "cmdline: $(cat /proc/cmdline)"
test "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs
none grep -q " - cgroup " /proc/self/mountinfo
echo "/sys/fs/cgroup is cgroup2 (no v1 hierarchy); root controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
grep " - cgroup2 " /proc/self/mountinfo'

check "dpkg -i" '
set -eo pipefail
mount -t 9p -o trans=virtio,version=9p2000.L,ro kici /mnt/kici
dpkg -i /mnt/kici/kici-scaler.deb | tail -n 3
systemctl is-enabled kici-scaler || true
kici-scaler --version'

check "packaged defaults: the API is the unix socket only (0600, root), no TCP port; root's client finds it, nobody is refused" '
set -e
stat -c "%a %U %n" /etc/default/kici-scaler /etc/kici-scaler/daemon.toml
test "$(stat -c %a /etc/default/kici-scaler)" = 600
test "$(stat -c %a /etc/kici-scaler/daemon.toml)" = 600
systemctl start kici-scaler
stat -c "%a %U %F %n" /run/kici-scaler/api.sock
test "$(stat -c %a /run/kici-scaler/api.sock)" = 600
test "$(stat -c %U /run/kici-scaler/api.sock)" = root
# 7878 = 0x1EC6; state 0A = LISTEN.
none grep -qE "^ *[0-9]+: [0-9A-F]+:1EC6 [0-9A-F]+:[0-9A-F]+ 0A" /proc/net/tcp /proc/net/tcp6
echo "nothing listens on TCP 7878"
kici-scaler status | head -n 3
none runuser -u nobody -- kici-scaler status
runuser -u nobody -- kici-scaler status 2>&1 | head -n 1 || true
systemctl stop kici-scaler'

check "configure: API on 0.0.0.0:7878 with a token; scalers local (1 CPU, 1g) and oom (0.5 CPU, 64m)" "
set -e
sed -i 's/^listen = .*/listen = \"0.0.0.0:7878\"/; s/^bare-metal-pids-max = .*/bare-metal-pids-max = 256/' /etc/kici-scaler/daemon.toml
echo 'KICI_SCALER_API_TOKEN=$token' >/etc/default/kici-scaler
cat >/etc/kici-scaler/scalers.d/10-oom.yaml <<'EOF'
scalers:
  - name: oom
    type: bare-metal
    maxAgents: 1
    enforceCgroups: true
    x-kici-scaler:
      user: kici-agent
    labelSets:
      - labels: [oom]
        binaryPath: /usr/bin/kici-agent-lite
        resources:
          requests: { cpus: 0.5, memory: 64m }
          limits: { cpus: 0.5, memory: 64m }
EOF
kici-scaler validate --config /etc/kici-scaler/scalers.yaml --config-dir /etc/kici-scaler/scalers.d"

check "systemctl start kici-scaler (Type=notify: returns once the API listens)" '
set -e
time systemctl start kici-scaler
systemctl is-active kici-scaler
pid=$(systemctl show -p MainPID --value kici-scaler)
unit=/sys/fs/cgroup/system.slice/kici-scaler.service
echo "main pid $pid in $(cut -d: -f3 /proc/$pid/cgroup)"
grep -qx "0::/system.slice/kici-scaler.service/daemon" /proc/$pid/cgroup
echo "unit cgroup: $unit (delegated: $(getfattr --only-values -n trusted.delegate $unit 2>/dev/null || echo "xattr unreadable"))"
echo "$unit/cgroup.procs: [$(cat $unit/cgroup.procs | tr "\n" " ")]"
journalctl -u kici-scaler -o cat | grep "cgroup placement" | head -n 2' 600

check "the unit's sandbox: systemd-analyze security exposure at most $MAX_EXPOSURE (the committed number)" "
set -e
systemd-analyze security kici-scaler.service | grep -E '^✗' | cut -c1-140 || true
score=\$(systemd-analyze security kici-scaler.service | sed -n 's/.*exposure level for kici-scaler.service: \\([0-9.]*\\).*/\\1/p')
echo \"exposure score: \$score (at most $MAX_EXPOSURE)\"
awk -v s=\"\$score\" -v max=$MAX_EXPOSURE 'BEGIN { exit !(s != \"\" && s + 0 <= max + 0) }'"

check "doctor: the service (delegated), this shell's unit (not delegated), --cgroup-root" '
set -e
echo "# kici-scaler doctor (from kici-vm-runner.service; the running daemon row is the service)"
kici-scaler doctor --config /etc/kici-scaler/scalers.yaml --state-dir /var/lib/kici-scaler | grep cgroup || true
echo "# systemd-run -p Delegate=yes kici-scaler doctor"
systemd-run --quiet --wait --pipe -p Delegate=yes kici-scaler doctor --config /etc/kici-scaler/scalers.yaml --state-dir /run/kici-doctor-state | grep cgroup || true
echo "# kici-scaler doctor --cgroup-root /sys/fs/cgroup/kici-test.slice"
mkdir -p /sys/fs/cgroup/kici-test.slice
kici-scaler doctor --config /etc/kici-scaler/scalers.yaml --state-dir /run/kici-doctor-state --cgroup-root /sys/fs/cgroup/kici-test.slice | grep cgroup || true
rmdir /sys/fs/cgroup/kici-test.slice' 600

log "--- a bare-metal job end to end: kici-scaler run --server $server (from this host)"
out=$(host_run --labels linux -- sh -c 'echo hello from the vm; cat /proc/self/cgroup; echo "user $(id -un)"
for f in /var/lib/kici-scaler/state.db /var/lib/kici-scaler/provision-claim.key /etc/default/kici-scaler /etc/kici-scaler/daemon.toml; do
    if cat "$f" >/dev/null 2>&1; then echo "read $f"; else echo "cannot read $f"; fi
done
for p in $(pgrep -x kici-scaler); do
    if tr "\0" "\n" <"/proc/$p/environ" >/dev/null 2>&1; then echo "read the daemon environ"; else echo "cannot read the daemon environ"; fi
done
if ls /var/lib/kici-scaler >/dev/null 2>&1; then echo "listed the state dir"; else echo "cannot list the state dir"; fi
cat /proc/$(pgrep -o -x kici-scaler)/environ 2>/dev/null || true') || die "run --server failed: $out"
printf '%s\n' "$out" | sed 's/^/    /'
grep -qx 'hello from the vm' <<<"$out" || die "the job's output did not come back"
grep -qx 'user kici-agent' <<<"$out" || die "the job did not run as kici-agent"
grep -qE '^(read|listed) ' <<<"$out" && die "the job read the daemon's secrets"
grep -q "$token" <<<"$out" && die "the API token reached the job"
[ "$(grep -c '^cannot ' <<<"$out")" -ge 6 ] || die "the job's read attempts did not all run"
agent_cgroup=$(sed -n 's/^0:://p' <<<"$out")
[[ $agent_cgroup == /system.slice/kici-scaler.service/agents/*/local/scaler-bare-metal-* ]] \
    || die "the agent ran in $agent_cgroup, not under the unit's agents/ subtree"
log "agent cgroup: $agent_cgroup"

log "--- limits in the agent's cgroup (scaler local: 1 CPU, 1g; pids.max 256)"
out=$(host_run --labels linux -- sh -c 'd=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup); cd $d; for f in cpu.max pids.max memory.max memory.swap.max memory.oom.group; do echo "$f $(cat $f 2>/dev/null || echo absent)"; done') \
    || die "run --server failed: $out"
printf '%s\n' "$out" | sed 's/^/    /'
grep -qx 'cpu.max 100000 100000' <<<"$out" || die "cpu.max is not 1 CPU"
grep -qx 'pids.max 256' <<<"$out" || die "pids.max is not 256"
grep -qx 'memory.max 1073741824' <<<"$out" || die "memory.max is not 1g"
grep -qx 'memory.oom.group 1' <<<"$out" || die "memory.oom.group is not 1"
grep -Eqx 'memory.swap.max (0|absent)' <<<"$out" || die "memory.swap.max is neither 0 nor absent"

log "--- OOM: an agent limited to 64m allocates 300m while another agent runs"
host_run --labels linux -- sh -c 'sleep 90; echo survivor done' >"$work/survivor.out" 2>&1 &
survivor=$!
check "the survivor agent runs" 'for i in $(seq 60); do pgrep -f "sleep 90" >/dev/null && exit 0; sleep 1; done; exit 1' 120
pid_before=$(vm 'systemctl show -p MainPID --value kici-scaler')
oom_rc=0
out=$(host_run --labels oom -- sh -c 'echo allocating; head -c 300m /dev/zero | tail >/dev/null; echo survived') || oom_rc=$?
printf '%s\n' "$out" | sed 's/^/    /'
log "the OOM job's run exited $oom_rc"
[ "$oom_rc" -ne 0 ] || die "the 64m agent was not killed"
grep -q survived <<<"$out" && die "the allocation survived its memory limit"
check "kernel OOM kill evidence (cgroup v2, the agent's cgroup only)" "
set -e
journalctl -k -o cat | grep 'oom-kill:' | tail -n 1 | tr , '\\n' | grep -E 'constraint|oom_memcg|task_memcg|task='
journalctl -k -o cat | grep 'Memory cgroup out of memory' | tail -n 4
journalctl -k -o cat | grep 'oom-kill:' | tail -n 1 | grep -q 'oom_memcg=/system.slice/kici-scaler.service/agents/.*/oom/scaler-bare-metal-'
test \"\$(systemctl show -p MainPID --value kici-scaler)\" = '$pid_before'
systemctl is-active kici-scaler
pgrep -f 'sleep 90' >/dev/null && echo 'the other agent still runs (sleep 90)'

journalctl -u kici-scaler -o cat | grep 'bare-metal agent exited' | tail -n 1 | cut -c1-300"
wait "$survivor" || die "the other agent did not survive the OOM kill: $(cat "$work/survivor.out")"
grep -qx 'survivor done' "$work/survivor.out" || die "the other agent's job did not finish: $(cat "$work/survivor.out")"
log "the other agent's job finished: survivor done"

check "systemctl reload (SIGHUP, same main pid)" '
set -e
pid=$(systemctl show -p MainPID --value kici-scaler)
systemctl reload kici-scaler
for i in $(seq 30); do journalctl -u kici-scaler -o cat | grep -q "SIGHUP: reloading" && break; sleep 1; done
journalctl -u kici-scaler -o cat | grep -E "SIGHUP|reload" | tail -n 3 | cut -c1-300
test "$(systemctl show -p MainPID --value kici-scaler)" = "$pid"
systemctl is-active kici-scaler' 120

log "--- systemctl stop with an agent running"
host_run --labels linux -- sleep 600 >"$work/stopped.out" 2>&1 &
stopped=$!
check "the agent runs" 'for i in $(seq 60); do pgrep -x kici-agent-lite >/dev/null && pgrep -f "sleep 600" >/dev/null && exit 0; sleep 1; done; exit 1' 120
check "systemctl stop leaves no agent process and no agent cgroup" '
set -e
time systemctl stop kici-scaler
none pgrep -x kici-agent-lite
none pgrep -f "sleep 600"
unit=/sys/fs/cgroup/system.slice/kici-scaler.service
if [ -d $unit ]; then find $unit -type d; echo "the unit cgroup is still there"; exit 1; fi
echo "no kici-agent-lite, no sleep 600, no $unit"
journalctl -u kici-scaler -o cat | grep -E "shutdown complete|shutting down" | tail -n 2 | cut -c1-200' 300
wait "$stopped" || log "the stopped agent's run exited $? (its job ended with the service)"

log "--- systemctl kill -s KILL with an agent running, then start"
check "start again" 'systemctl start kici-scaler && systemctl is-active kici-scaler' 300
host_run --labels linux -- sleep 600 >"$work/killed.out" 2>&1 &
killed=$!
check "the agent runs" 'for i in $(seq 60); do pgrep -f "sleep 600" >/dev/null && exit 0; sleep 1; done; exit 1' 120
check "kill -9 everything, then start: recovery" '
set -e
old=$(systemctl show -p MainPID --value kici-scaler)
agent=$(kici-scaler agents --server http://127.0.0.1:7878 | awk "/scaler-bare-metal/ {print \$1; exit}")
echo "agent before the kill: $agent"
systemctl kill -s KILL kici-scaler
for i in $(seq 30); do systemctl is-active -q kici-scaler || break; sleep 0.5; done
systemctl start kici-scaler
systemctl is-active kici-scaler
new=$(systemctl show -p MainPID --value kici-scaler)
echo "main pid $old -> $new"
test "$new" != "$old"
none pgrep -f "sleep 600"
journalctl -u kici-scaler -o cat _PID=$new | grep -E "recovery done|reconcile pass" | head -n 2 | cut -c1-300
kici-scaler agents --all --server http://127.0.0.1:7878 | grep "$agent"
kici-scaler agents --all --server http://127.0.0.1:7878 | grep "$agent" | grep -q gone
leftover=$(find /sys/fs/cgroup/system.slice/kici-scaler.service/agents -mindepth 3 -type d 2>/dev/null | wc -l)
echo "agent cgroups left: $leftover"
test "$leftover" -eq 0' 300
wait "$killed" || true
out=$(host_run --labels linux -- echo "jobs run again") || die "no job after the recovery: $out"
grep -qx "jobs run again" <<<"$out" || die "no job after the recovery: $out"
log "after the recovery: jobs run again"

check "the README's quickstart as root: kici-scaler run --config quickstart.yaml" '
set -e
cd /root
kici-scaler run --config /mnt/kici/quickstart.yaml --labels linux -- sh -c "echo hello from a kici agent"
rc=0; kici-scaler run --config /mnt/kici/quickstart.yaml --labels linux -- sh -c "exit 3" || rc=$?
echo "sh -c \"exit 3\": run exited $rc"
test "$rc" -eq 3' 300

check "an unprivileged user: kici-scaler run (it enters a delegated user scope itself)" '
set -e
uid=$(id -u kici)
printf "version: 1\nscalers:\n  - name: mine\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [linux]\n        binaryPath: /usr/bin/kici-agent-lite\n" >/home/kici/quickstart.yaml
for i in $(seq 60); do systemctl is-active -q user@$uid.service && break; sleep 1; done
cd /home/kici
as_kici() { runuser -u kici -- env XDG_RUNTIME_DIR=/run/user/$uid DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/$uid/bus "$@"; }
as_kici kici-scaler run --config /mnt/kici/quickstart.yaml --labels linux -- sh -c "echo hello from a kici agent"
out=$(as_kici kici-scaler run --config /home/kici/quickstart.yaml --labels linux -- sh -c "echo hello from \$(id -un); cat /proc/self/cgroup")
echo "$out"
echo "$out" | grep -qx "hello from kici"
echo "$out" | grep -Eq "^0::/user.slice/user-$uid.slice/user@$uid.service/.*[.]scope/agents/[0-9a-f]+/mine/scaler-bare-metal-"' 300

check "an unprivileged user in the docker group: a container job (kici-scaler run)" '
set -e
uid=$(id -u kici)
id -nG kici | grep -qw docker
timeout 240 systemctl start docker
docker load -q -i /mnt/kici/agent-image.tar
as_kici() { runuser -u kici -- env XDG_RUNTIME_DIR=/run/user/$uid DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/$uid/bus "$@"; }
cd /home/kici
scaler() {
    printf "version: 1\nscalers:\n  - name: boxes\n    type: container\n    maxAgents: 1\n    networkIsolation: %s\n    labelSets:\n      - labels: [linux]\n        image: kici-agent-lite:vm-test\n        imagePullPolicy: Never\n" "$1"
}
# Egress rules need nftables, which needs root: refused, with the reason,
# before any container exists.
scaler true >/home/kici/isolated.yaml
rc=0; out=$(as_kici kici-scaler run --config /home/kici/isolated.yaml --labels linux -- sh -c "echo should not run" 2>&1) || rc=$?
echo "$out" | tail -n 3
test "$rc" -ne 0
echo "$out" | grep -qi "networkIsolation"
none grep -q "should not run" <<<"$out"
scaler false >/home/kici/boxes.yaml
out=$(as_kici kici-scaler run --config /home/kici/boxes.yaml --labels linux -- sh -c "echo hello from a container as \$(id -u)")
echo "$out"
echo "$out" | grep -qx "hello from a container as [0-9]*"
left=$(docker ps -aq --filter label=dev.kici.scaler.instance | wc -l)
echo "containers left: $left"
test "$left" -eq 0' 600

log "PASSED in $(elapsed)"
vm 'systemctl poweroff' 30 >/dev/null 2>&1 || true
