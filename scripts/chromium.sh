#!/usr/bin/env bash
# Chromium from Debian, for the dashboard's browser test (driven by Playwright's Python
# package pointed at this executable; Playwright's own browser downloads are never used).
#
#   scripts/chromium.sh install     install chromium from Debian if none is found
#   scripts/chromium.sh bin         print the chromium binary's path (exit 1 when there is none)
set -euo pipefail

die() { echo "chromium.sh: $*" >&2; exit 1; }

chromium_bin() {
    command -v chromium || { [[ -x /usr/bin/chromium ]] && echo /usr/bin/chromium; } || true
}

cmd_install() {
    if [[ -n "$(chromium_bin)" ]]; then
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "chromium is missing and this is not root (no sudo)"
        sudo="sudo"
    fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium >/dev/null
    [[ -n "$(chromium_bin)" ]] || die "chromium still missing after apt-get install"
}

cmd_bin() {
    local bin
    bin="$(chromium_bin)"
    [[ -n "$bin" ]] || die "chromium is not installed (scripts/chromium.sh install)"
    echo "$bin"
}

case "${1:-}" in
    install) cmd_install ;;
    bin) cmd_bin ;;
    *) die "usage: scripts/chromium.sh install|bin" ;;
esac
