#!/usr/bin/env bash
# Run a throw-away Redis (or Valkey) server on loopback for the L3 cache tier and its tests.
#
#   scripts/redis.sh install                      install redis-server from Debian if missing
#   scripts/redis.sh start PORT [DIR]             start daemonized on 127.0.0.1:PORT, no persistence;
#                                                 pid file DIR/redis-PORT.pid, log DIR/redis-PORT.log
#   scripts/redis.sh run PORT [DIR]               same, in the foreground (Ctrl-C stops it)
#   scripts/redis.sh stop PORT [DIR]              stop the server started with that PORT and DIR
#   scripts/redis.sh ping PORT                    exit 0 when the server answers PING
#
# DIR defaults to $SEMCACHE_REDIS_DIR or .data/redis. The server binds 127.0.0.1 only, saves
# nothing to disk (no RDB, no AOF) and is not a Debian service: nothing starts at boot.
set -euo pipefail

die() { echo "redis.sh: $*" >&2; exit 1; }

server_bin() {
    command -v redis-server || command -v valkey-server || true
}

cli_bin() {
    command -v redis-cli || command -v valkey-cli || true
}

cmd_install() {
    if [[ -n "$(server_bin)" ]]; then
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "redis-server is missing and this is not root (no sudo)"
        sudo="sudo"
    fi
    # Debian starts the packaged service on install unless policy-rc.d forbids it; we stop it
    # below when it did, so that only the servers this script starts are running.
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        redis-server >/dev/null
    if command -v service >/dev/null && service redis-server status >/dev/null 2>&1; then
        $sudo service redis-server stop >/dev/null 2>&1 || true
    fi
    [[ -n "$(server_bin)" ]] || die "redis-server still missing after apt-get install"
}

run_dir() {
    local dir="${1:-${SEMCACHE_REDIS_DIR:-.data/redis}}"
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

check_port() {
    [[ "${1:-}" =~ ^[0-9]+$ ]] || die "PORT must be a number, got '${1:-}'"
}

# Fills the array ARGS with the server's command line.
server_args() {
    local port="$1" dir="$2" daemonize="$3" logfile="$4"
    ARGS=(--port "$port" --bind 127.0.0.1 --protected-mode yes
        --save "" --appendonly no --dir "$dir"
        --daemonize "$daemonize" --pidfile "$dir/redis-$port.pid"
        --logfile "$logfile" --loglevel warning)
}

cmd_ping() {
    check_port "${1:-}"
    local cli
    cli="$(cli_bin)"
    if [[ -n "$cli" ]]; then
        [[ "$("$cli" -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]
    else
        # No client binary: speak RESP with bash's /dev/tcp.
        exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
        printf 'PING\r\n' >&3
        local reply
        IFS= read -r -t 2 reply <&3 || return 1
        exec 3>&-
        [[ "$reply" == "+PONG"* ]]
    fi
}

cmd_start() {
    check_port "${1:-}"
    cmd_install
    local port="$1" dir bin
    dir="$(run_dir "${2:-}")"
    bin="$(server_bin)"
    server_args "$port" "$dir" yes "$dir/redis-$port.log"
    "$bin" "${ARGS[@]}"
    for _ in $(seq 1 100); do
        if cmd_ping "$port"; then
            echo "$dir/redis-$port.pid"
            return 0
        fi
        sleep 0.05
    done
    die "redis-server on port $port did not answer within 5 s (see $dir/redis-$port.log)"
}

cmd_run() {
    check_port "${1:-}"
    cmd_install
    local port="$1" dir bin
    dir="$(run_dir "${2:-}")"
    bin="$(server_bin)"
    server_args "$port" "$dir" no ""
    exec "$bin" "${ARGS[@]}"
}

cmd_stop() {
    check_port "${1:-}"
    local port="$1" dir pidfile pid
    dir="$(run_dir "${2:-}")"
    pidfile="$dir/redis-$port.pid"
    [[ -f "$pidfile" ]] || return 0
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$pidfile"
}

case "${1:-}" in
    install) cmd_install ;;
    start) shift; cmd_start "$@" ;;
    run) shift; cmd_run "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    ping) shift; cmd_ping "$@" ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
