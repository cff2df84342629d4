#!/bin/sh
# A minimal jailer stand-in for kici-firecracker's own tests (crates/testkit
# brings the faithful one): the documented flags, the chroot path rule
# (basename of the canonicalised exec file), the copied exec file, the pid
# file written create-new, and the jailer exiting at once as under
# --new-pid-ns. @PIDS@ is replaced by the test with a directory where every
# started VMM's pid is also recorded (to prove nothing survives).
set -eu
id= exec_file= base=/srv/jailer
while [ $# -gt 0 ]; do
  case "$1" in
    --id) id=$2; shift 2 ;;
    --exec-file) exec_file=$2; shift 2 ;;
    --chroot-base-dir) base=$2; shift 2 ;;
    --uid|--gid|--cgroup-version|--parent-cgroup|--cgroup) shift 2 ;;
    --new-pid-ns) shift ;;
    --) shift; break ;;
    *) echo "fake jailer: unknown flag $1" >&2; exit 2 ;;
  esac
done
exec_real=$(readlink -f "$exec_file")
name=$(basename "$exec_real")
root="$base/$name/$id/root"
mkdir -p "$root/run" "$root/dev/net"
cp "$exec_real" "$root/$name"
[ ! -e "$root/$name.pid" ] || { echo "fake jailer: pid file exists" >&2; exit 1; }
FAKE_ROOT="$root" setsid "$exec_real" --id "$id" "$@" </dev/null &
echo $! > "$root/$name.pid"
echo $! > "@PIDS@/$id"
exit 0
