#!/usr/bin/env bash
# Starts, stops or reports the local Docker Engine (Debian's docker.io) for
# kici-scaler's container backend and its tests. The machines have no systemd:
# dockerd runs in the background, started by this script.
#
#   scripts/dockerd.sh start    start dockerd unless its socket already answers
#   scripts/dockerd.sh stop     stop the dockerd this script started (pid file)
#   scripts/dockerd.sh status   exit 0 when the socket answers, 1 otherwise
#
# Idempotent: `start` with a daemon already answering does nothing (whoever
# started it); `stop` only stops a daemon whose pid this script recorded.
# Environment:
#   KICI_DOCKERD_LOG      log file (default /var/log/kici-dockerd.log, /tmp if
#                         /var/log is not writable)
#   KICI_DOCKERD_TIMEOUT  seconds to wait for `docker info` (default 20)
#   DOCKER_HOST           the socket to probe (default unix:///var/run/docker.sock)
set -euo pipefail

SOCKET_URL="${DOCKER_HOST:-unix:///var/run/docker.sock}"
PIDFILE=/var/run/kici-dockerd.pid
TIMEOUT="${KICI_DOCKERD_TIMEOUT:-20}"

log() { printf 'dockerd.sh: %s\n' "$*" >&2; }

log_file() {
    if [ -n "${KICI_DOCKERD_LOG:-}" ]; then
        echo "$KICI_DOCKERD_LOG"
    elif [ -w /var/log ]; then
        echo /var/log/kici-dockerd.log
    else
        echo /tmp/kici-dockerd.log
    fi
}

# The socket answers an API request (not merely exists: a stale socket file
# of a dead daemon must not count).
answers() {
    if command -v docker >/dev/null; then
        DOCKER_HOST="$SOCKET_URL" timeout 5 docker version --format '{{.Server.APIVersion}}' >/dev/null 2>&1
    else
        local path="${SOCKET_URL#unix://}"
        [ -S "$path" ] && timeout 5 curl -fsS --unix-socket "$path" http://localhost/_ping >/dev/null 2>&1
    fi
}

start() {
    if answers; then
        log "dockerd already answers on $SOCKET_URL"
        return 0
    fi
    if ! command -v dockerd >/dev/null; then
        log "dockerd not found: install docker.io (scripts/install-deps.sh)"
        return 1
    fi
    if [ "$(id -u)" -ne 0 ]; then
        log "dockerd must be started as root"
        return 1
    fi
    # A daemon that died without cleaning up leaves its pid file behind, and
    # dockerd refuses to start while /var/run/docker.pid names a live process.
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        rm -f /var/run/docker.pid
    fi
    local logf
    logf="$(log_file)"
    log "starting dockerd (log: $logf)"
    # setsid: the daemon outlives this script and the shell that ran it.
    setsid dockerd >>"$logf" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    local waited=0
    while ! answers; do
        if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            log "dockerd exited during start-up; last log lines:"
            tail -n 20 "$logf" >&2 || true
            rm -f "$PIDFILE"
            return 1
        fi
        if [ "$waited" -ge $((TIMEOUT * 10)) ]; then
            log "dockerd did not answer within ${TIMEOUT}s; last log lines:"
            tail -n 20 "$logf" >&2 || true
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    log "dockerd answers on $SOCKET_URL (pid $(cat "$PIDFILE"))"
}

stop() {
    if [ ! -f "$PIDFILE" ]; then
        log "no dockerd started by this script (no $PIDFILE); nothing stopped"
        return 0
    fi
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
        log "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        local waited=0
        while kill -0 "$pid" 2>/dev/null; do
            if [ "$waited" -ge 300 ]; then
                log "dockerd (pid $pid) still running after 30s; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.1
            waited=$((waited + 1))
        done
    fi
    rm -f "$PIDFILE"
}

status() {
    if answers; then
        log "dockerd answers on $SOCKET_URL"
        return 0
    fi
    log "dockerd does not answer on $SOCKET_URL"
    return 1
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 64 ;;
esac
