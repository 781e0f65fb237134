#!/usr/bin/env bash
# wrk, the load generator of the benches (bench/lib/wrk.py): an httpx client tops out near
# 300 req/s here, wrk does not.
#
#   scripts/wrk.sh install     install wrk from Debian if missing
#
set -euo pipefail

die() { echo "wrk.sh: $*" >&2; exit 1; }

cmd_install() {
    if command -v wrk >/dev/null; then
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "wrk is missing and this is not root (no sudo)"
        sudo="sudo"
    fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        wrk >/dev/null
    command -v wrk >/dev/null || die "wrk still missing after apt-get install"
}

case "${1:-}" in
    install) cmd_install ;;
    *) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
