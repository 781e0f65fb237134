#!/usr/bin/env bash
# The tests' multi-host cluster on this one machine: hosts as network namespaces on a private
# bridge (lb, gw1, gw2, redis, p1, d1 on 10.77.0.0/24; see harness/cluster/ and docs/deploy.md).
# A developer tool: what tests/server/test_cluster.py proves the multi-host topology on and
# the benches measure (the tests' tiny model and tokens), not a deployment of Semcache.
#
#   scripts/cluster.sh up [--kv-transport tcp|shm] [--cache-cluster]
#                                                    build and start what is missing (idempotent);
#                                                    --cache-cluster: the shared tier replicated
#                                                    (Redis Cluster, 3 hosts x 3 nodes)
#   scripts/cluster.sh down                          stop everything it started, delete the hosts
#   scripts/cluster.sh status                        what runs
#   scripts/cluster.sh requirements                  what this machine lacks
#
# Needs root (network namespaces), iproute2's `ip`, haproxy and redis-server (installed here
# from Debian when missing and root) and the project's venv with vLLM (`make install`).
# Configs, logs and pid files: .data/test/cluster (--run-dir DIR to change).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

case "${1:-}" in
    up)
        if [[ "$(id -u)" == "0" ]]; then
            bash scripts/redis.sh install
            bash scripts/haproxy.sh install
        fi
        ;;
    down | status | requirements) ;;
    *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m harness.cluster "$@"
