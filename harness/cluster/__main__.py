"""``python -m harness.cluster up|down|status|requirements [--run-dir DIR]
[--kv-transport tcp|shm] [--cache-cluster]``, what ``scripts/cluster.sh`` runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.cluster import TOKEN, Cluster, ClusterError, missing_requirements


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.cluster",
        description="the namespaced cluster the tests prove the multi-host topology on",
    )
    ap.add_argument("action", choices=["up", "down", "status", "requirements"])
    ap.add_argument("--run-dir", type=Path, default=None, help="default: .data/test/cluster")
    ap.add_argument("--kv-transport", choices=["tcp", "shm"], default="tcp")
    ap.add_argument(
        "--cache-cluster",
        action="store_true",
        help="the shared tier as a Redis Cluster on hosts c1-c3 (3 primaries, 2 replicas each)",
    )
    args = ap.parse_args(argv)
    if args.action == "requirements":
        missing = missing_requirements()
        print("missing: " + ", ".join(missing) if missing else "everything is here")
        return 1 if missing else 0
    cluster = Cluster(
        args.run_dir, kv_transport=args.kv_transport, cache_cluster=args.cache_cluster
    )
    if args.action == "down":
        cluster.down()
        print("cluster down")
        return 0
    if args.action == "up":
        try:
            cluster.up()
        except ClusterError as exc:
            print(f"cluster: {exc}", file=sys.stderr)
            return 1
        print(f"cluster up: LB {cluster.lb_url}, token {TOKEN}, logs {cluster.run_dir / 'logs'}")
    for name, running in cluster.status().items():
        print(f"{name:8} {cluster.where(name):18} {'up' if running else 'down'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
