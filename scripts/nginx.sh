#!/usr/bin/env bash
# nginx from Debian, for the tests and benchmarks that put an HTTP cache in front of the
# gateway (each starts its own nginx in the foreground, with a config in a temp dir).
#
#   scripts/nginx.sh install     install nginx-light from Debian if no nginx is found
#   scripts/nginx.sh bin         print the nginx binary's path (exit 1 when there is none)
#
# The Debian service is stopped after the install when it started: only the nginx processes
# the tests start run, on free loopback ports.
set -euo pipefail

die() { echo "nginx.sh: $*" >&2; exit 1; }

nginx_bin() {
    command -v nginx || { [[ -x /usr/sbin/nginx ]] && echo /usr/sbin/nginx; } || true
}

cmd_install() {
    if [[ -n "$(nginx_bin)" ]]; then
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "nginx is missing and this is not root (no sudo)"
        sudo="sudo"
    fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        nginx-light >/dev/null
    if command -v service >/dev/null && service nginx status >/dev/null 2>&1; then
        $sudo service nginx stop >/dev/null 2>&1 || true
    fi
    [[ -n "$(nginx_bin)" ]] || die "nginx still missing after apt-get install"
}

cmd_bin() {
    local bin
    bin="$(nginx_bin)"
    [[ -n "$bin" ]] || die "nginx is not installed (scripts/nginx.sh install)"
    echo "$bin"
}

case "${1:-}" in
    install) cmd_install ;;
    bin) cmd_bin ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
