"""The shared tier: one redis-server on ``redis``, or a Redis Cluster on c1-c3 (three
primaries with two replicas each, no two copies of a slot on one host) and what the tests
ask of it (is every slot served, which node is a key's primary, the failover's end)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from harness.cluster.processes import Processes, Service
from harness.cluster.topology import (
    CACHE_HOSTS,
    CACHE_PORTS,
    REDIS_PORT,
    ClusterError,
    address,
    cache_node,
    host_of,
)

CACHE_REPLICAS = 2
CACHE_NODE_TIMEOUT_MS = 2000
"""How long a primary may stay silent before its replica is promoted (``cluster-node-timeout``)."""


def _binary(name: str) -> str:
    return shutil.which(f"redis-{name}") or shutil.which(f"valkey-{name}") or f"redis-{name}"


def redis_url(cache_cluster: bool) -> str:
    """The URL every gateway's config and policy give for the shared tier."""
    if cache_cluster:
        nodes = ",".join(f"{address(h)}:{CACHE_PORTS[0]}" for h in CACHE_HOSTS)
        return f"redis+cluster://{nodes}"
    return f"redis://{address('redis')}:{REDIS_PORT}/0"


def redis_service(run_dir: Path) -> Service:
    """redis-server on ``redis``, no persistence."""
    command = [_binary("server"), "--bind", address("redis"), "--port", str(REDIS_PORT)]
    command += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
    command += ["--dir", str(run_dir), "--loglevel", "warning"]
    return Service("redis", command, {}, None, REDIS_PORT)


def cache_node_services(run_dir: Path) -> dict[str, Service]:
    """The nine cluster-enabled nodes, by service name (``c1-6379``, ...)."""
    services = {}
    for host in CACHE_HOSTS:
        for port in CACHE_PORTS:
            directory = run_dir / "cache" / cache_node(host, port)
            directory.mkdir(parents=True, exist_ok=True)
            command = [_binary("server"), "--bind", address(host), "--port", str(port)]
            command += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
            command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            command += ["--cluster-node-timeout", str(CACHE_NODE_TIMEOUT_MS)]
            command += ["--dir", str(directory), "--loglevel", "warning"]
            services[cache_node(host, port)] = Service(host, command, {}, None, port)
    return services


class CacheCluster:
    """The Redis Cluster on c1-c3, through ``redis-cli``."""

    def __init__(self, processes: Processes) -> None:
        self.processes = processes

    def _cli(self, host: str, port: int, *args: str) -> str:
        done = subprocess.run(
            [_binary("cli"), "-h", address(host), "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip()

    def _live(self) -> list[tuple[str, int]]:
        nodes = [(h, p) for h in CACHE_HOSTS for p in CACHE_PORTS]
        return [(h, p) for h, p in nodes if self.processes.running(cache_node(h, p))]

    def ok(self) -> bool:
        """Every live node says ``cluster_state:ok`` with all 16384 slots served."""
        live = self._live()
        for host, port in live:
            info = self._cli(host, port, "cluster", "info")
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
        return bool(live)

    def create(self, timeout_s: float = 60.0) -> None:
        """Join the nine nodes into one cluster (once: a kept cluster is left as it is), with
        ``redis-cli --cluster create``, which puts no replica on its primary's host."""
        if not self.ok():
            create = [_binary("cli"), "--cluster", "create"]
            create += [f"{address(h)}:{p}" for p in CACHE_PORTS for h in CACHE_HOSTS]
            create += ["--cluster-replicas", str(CACHE_REPLICAS), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise ClusterError(f"cluster create failed: {done.stdout}{done.stderr}")
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 60.0) -> float:
        """Seconds until the shared tier serves every slot again (after a failover, say)."""
        began = time.monotonic()
        while not self.ok():
            if time.monotonic() - began > timeout_s:
                raise ClusterError(f"the cache cluster is not ok after {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - began

    def wait_failover(self, key: str, lost: str, timeout_s: float = 60.0) -> float:
        """Seconds until a node other than ``lost`` serves ``key``'s slot as primary and
        every slot is served: the failover after ``lost`` died."""
        began = time.monotonic()
        while self.primary(key) in ("", lost) or not self.ok():
            if time.monotonic() - began > timeout_s:
                raise ClusterError(f"no replica took over from {lost} in {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - began

    def primary(self, key: str) -> str:
        """The cache node (service name) that serves ``key``'s slot as primary now."""
        for h, p in self._live()[:1]:  # one live node's view is enough
            slot = int(self._cli(h, p, "cluster", "keyslot", key))
            for line in self._cli(h, p, "cluster", "nodes").splitlines():
                fields = line.split()
                if "master" not in fields[2] or "fail" in fields[2]:
                    continue
                for part in fields[8:]:
                    low, _, high = part.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        node_host, node_port = fields[1].split("@")[0].rsplit(":", 1)
                        return cache_node(host_of(node_host), int(node_port))
        return ""
