#!/usr/bin/env bash
# A throwaway PostgreSQL 15 for tests and benches.
#
#   scripts/postgres.sh start    init (first time) and start; already running → ok
#   scripts/postgres.sh stop     fast shutdown; not running → ok
#   scripts/postgres.sh status   exit 0 when accepting connections, 1 otherwise
#   scripts/postgres.sh url      print the postgres:// URL (what tests read from
#                                KICI_SCALER_TEST_POSTGRES)
#
# Environment:
#   KICI_PG_PORT  TCP port on 127.0.0.1 (default 54329). Each port is its own
#                 cluster under $KICI_PG_BASE/<port>, so a test can run (and
#                 stop) a private server beside the shared one.
#   KICI_PG_BASE  parent dir (default /var/tmp/kici-scaler-pg); every parent
#                 must be traversable by the postgres user.
#   KICI_PG_BIN   server binaries (default /usr/lib/postgresql/15/bin).
#   KICI_PG_MAX_CONNECTIONS  the server's max_connections (default 300; a
#                 stock server has 100). Only at start.
#   KICI_PG_LISTEN  extra address to listen on beside 127.0.0.1 (the fleet
#                 tests' bridge address, reachable from their network
#                 namespaces); its /24 gets trust auth too. Only at start.
#
# The server runs as `postgres` (initdb refuses root), listens on 127.0.0.1
# only, with its socket in <dir>/sock (no /var/run/postgresql without
# systemd), trust auth (loopback, throwaway), and fsync + synchronous_commit
# ON so benchmark numbers are honest. Concurrent `start`s are serialised
# with flock.
set -euo pipefail

port="${KICI_PG_PORT:-54329}"
base="${KICI_PG_BASE:-/var/tmp/kici-scaler-pg}"
bin="${KICI_PG_BIN:-/usr/lib/postgresql/15/bin}"
dir="$base/$port"
data="$dir/data"
sock="$dir/sock"
log="$dir/postgres.log"

die() { echo "postgres.sh: $*" >&2; exit 1; }

as_pg() {
    if [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

url() { echo "postgres://postgres@127.0.0.1:$port/postgres"; }

running() {
    [ -f "$data/postmaster.pid" ] && as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1
}

ready() { "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -t 5; }

check_traversable() {
    local p="$1"
    while [ "$p" != "/" ] && [ -n "$p" ]; do
        if ! as_pg test -x "$p"; then
            die "$p is not traversable by the postgres user (chmod o+x it or set KICI_PG_BASE)"
        fi
        p="$(dirname "$p")"
    done
}

start() {
    [ -x "$bin/postgres" ] || die "no PostgreSQL server in $bin (apt-get install postgresql-15)"
    mkdir -p "$base"
    chmod 0755 "$base"
    exec 9>"$base/.lock-$port"
    flock 9
    if running; then
        ready || die "server on port $port is up but not accepting connections; see $log"
        echo "postgres.sh: already running on 127.0.0.1:$port"
        return 0
    fi
    mkdir -p "$dir" "$sock"
    if [ "$(id -u)" -eq 0 ]; then chown postgres:postgres "$dir" "$sock"; fi
    chmod 0700 "$sock"
    check_traversable "$dir"
    if [ ! -f "$data/PG_VERSION" ]; then
        rm -rf "$data"
        as_pg "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
            || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    fi
    local listen="127.0.0.1"
    if [ -n "${KICI_PG_LISTEN:-}" ]; then
        listen="127.0.0.1,${KICI_PG_LISTEN}"
        local net="${KICI_PG_LISTEN%.*}.0/24"
        grep -qF "host all all $net trust" "$data/pg_hba.conf" \
            || echo "host all all $net trust" >>"$data/pg_hba.conf"
    fi
    # 9>&-: the server must not inherit (and so hold forever) the start lock.
    as_pg "$bin/pg_ctl" -D "$data" -l "$log" -w -t 30 start 9>&- -o \
        "-k $sock -c listen_addresses=$listen -p $port -c fsync=on -c synchronous_commit=on -c max_connections=${KICI_PG_MAX_CONNECTIONS:-300}" \
        >/dev/null || { tail -20 "$log" >&2; die "start failed"; }
    ready || die "started but not accepting connections; see $log"
    echo "postgres.sh: started on 127.0.0.1:$port (data $data)"
}

stop() {
    if running; then
        as_pg "$bin/pg_ctl" -D "$data" -m fast -w -t 30 stop >/dev/null
        echo "postgres.sh: stopped 127.0.0.1:$port"
    else
        echo "postgres.sh: not running on 127.0.0.1:$port"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) if running && ready; then echo "running on 127.0.0.1:$port"; else echo "not running on 127.0.0.1:$port"; exit 1; fi ;;
    url) url ;;
    *) die "usage: $0 start|stop|status|url" ;;
esac
