#!/usr/bin/env bash
# HAProxy for the multi-host cluster (harness/cluster/, scripts/cluster.sh): the load
# balancer in front of the gateways.
#
#   scripts/haproxy.sh install     install haproxy from Debian if missing (not started as a
#                                  service: the cluster runs its own instance)
set -euo pipefail

die() { echo "haproxy.sh: $*" >&2; exit 1; }

cmd_install() {
    if command -v haproxy >/dev/null; then
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "haproxy is missing and this is not root (no sudo)"
        sudo="sudo"
    fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        haproxy >/dev/null
    if command -v service >/dev/null && service haproxy status >/dev/null 2>&1; then
        $sudo service haproxy stop >/dev/null 2>&1 || true
    fi
    command -v haproxy >/dev/null || die "haproxy still missing after apt-get install"
}

case "${1:-}" in
    install) cmd_install ;;
    *) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
