#!/usr/bin/env bash
# Podman and the image tools, from Debian, and what makes podman run on this machine.
#
#   scripts/podman.sh install        install podman, buildah, mmdebstrap, podman-compose, the
#                                    runtimes and iptables (apt; needs root or sudo)
#   scripts/podman.sh env IMAGE      print `export CONTAINERS_CONF=...` when podman as
#                                    installed cannot run IMAGE here and the fallback can
#                                    (nothing when it can; exit 1 when neither can)
#
# The fallback (.data/podman/containers.conf) is for sandboxes like the one the project's
# tests run in: a hybrid cgroup hierarchy, which crun refuses ("cgroups in hybrid mode not
# supported"), and no CAP_SYS_RESOURCE, so podman's default ulimits (nofile 1048576) are
# refused. It names runc and ulimits within this process's hard limits. Machines where podman
# works as installed never use it.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "podman.sh: $*" >&2; exit 1; }
# iptables: bookworm's netavark (1.4) sets up `podman run -p` with iptables, its only firewall
# driver there (no nftables one), and podman only suggests it: without it `podman run -p` fails
# with "netavark: No such file or directory".
PACKAGES=(podman buildah mmdebstrap podman-compose crun runc uidmap slirp4netns fuse-overlayfs
          netavark aardvark-dns iptables)
CONF=.data/podman/containers.conf

cmd_install() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    local sudo=""
    if [[ "$(id -u)" != "0" ]]; then
        command -v sudo >/dev/null || die "missing ${missing[*]} and this is not root (no sudo)"
        sudo="sudo"
    fi
    echo "[podman] installing ${missing[*]} from Debian"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

runs() {  # runs IMAGE: podman (with the current CONTAINERS_CONF) can start a container of it
    timeout 120 podman run --rm --network none "$1" true >/dev/null 2>"$2"
}

cmd_env() {
    local image=${1:?usage: podman.sh env IMAGE}
    local why
    why=$(mktemp)
    if env -u CONTAINERS_CONF bash -c "$(declare -f runs); runs '$image' '$why'"; then
        rm -f "$why"
        return 0
    fi
    mkdir -p "$(dirname "$CONF")"
    local nofile nproc
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [[ "$nofile" == unlimited || "$nofile" -gt 1048576 ]] && nofile=1048576
    # Above 32768 this sandbox refuses RLIMIT_NPROC inside the container whatever the hard
    # limit says; 32768 processes are plenty for one container.
    [[ "$nproc" == unlimited || "$nproc" -gt 32768 ]] && nproc=32768
    cat >"$CONF" <<EOF
# Written by scripts/podman.sh: podman as installed cannot start a container here:
# $(head -c 300 "$why" | tr '\n' ' ')
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
    rm -f "$why"
    why=$(mktemp)
    if CONTAINERS_CONF="$PWD/$CONF" runs "$image" "$why"; then
        rm -f "$why"
        echo "export CONTAINERS_CONF=$PWD/$CONF"
        return 0
    fi
    echo "podman.sh: no container runs here, even with $CONF: $(cat "$why")" >&2
    rm -f "$why"
    return 1
}

case "${1:-}" in
    install) cmd_install ;;
    env) shift; cmd_env "$@" ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
