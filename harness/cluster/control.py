"""The cluster as one object: what runs on which host, ``up``, ``down`` and the faults.

Everything runs from files under ``run_dir`` (configs, logs, a pid file per process), so
``up`` and ``down`` work from separate invocations (``scripts/cluster.sh``) and both are
idempotent: ``up`` starts what is not running, ``down`` stops whatever a pid file names and
deletes the namespaces. It needs root, ``ip`` with netns support, ``haproxy`` and
``redis-server`` (``missing_requirements`` says which are absent).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from harness.cluster import faults
from harness.cluster.gateways import gateway_config, gateway_service, policy
from harness.cluster.gateways import gateway_url as _gateway_url
from harness.cluster.haproxy import LoadBalancer, haproxy_config, haproxy_service
from harness.cluster.haproxy import lb_url as _lb_url
from harness.cluster.network import build_network, missing_requirements, remove_network
from harness.cluster.processes import Processes, Service
from harness.cluster.redis import CacheCluster, cache_node_services, redis_service, redis_url
from harness.cluster.topology import (
    ADDRESSES,
    CACHE_HOSTS,
    CACHE_PORTS,
    GATEWAYS,
    SPARES,
    ClusterError,
    KvTransport,
    address,
    cache_node,
)
from harness.cluster.vllm import vllm_service
from harness.cluster.vllm import vllm_url as _vllm_url
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir


class Cluster(Processes):
    """The hosts, their configs and their processes, all kept under ``run_dir``."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        data_dir: Path | None = None,
        kv_transport: KvTransport = "tcp",
        gateway_cores: Mapping[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        cache_cluster: bool = False,
    ) -> None:
        """``cache_cluster``: the shared tier is a Redis Cluster on hosts c1-c3 (three
        primaries, two replicas each, no two copies of a slot on one host) instead of one
        redis-server on ``redis``, and the gateways wait for a replica before acknowledging
        a batch submit, a file upload or a ledger flush."""
        self.data_dir = (data_dir or test_data_dir()).resolve()
        super().__init__(
            (run_dir or self.data_dir / "cluster").resolve(), self.services, ready_timeout_s
        )
        self.kv_transport: KvTransport = kv_transport
        self.gateway_cores = dict(gateway_cores or {})
        self.cache_cluster = cache_cluster
        self.model = self.data_dir / "models" / TINY_MODEL_NAME
        self.lb = LoadBalancer(self.run_dir)
        self.cache = CacheCluster(self)

    # -- addresses --------------------------------------------------------------------

    @property
    def lb_url(self) -> str:
        return _lb_url()

    def gateway_url(self, host: str) -> str:
        return _gateway_url(host)

    def vllm_url(self, host: str) -> str:
        return _vllm_url(host)

    @property
    def redis_url(self) -> str:
        return redis_url(self.cache_cluster)

    @property
    def cache_hosts(self) -> tuple[str, ...]:
        """The hosts of the shared tier."""
        return CACHE_HOSTS if self.cache_cluster else ("redis",)

    def where(self, name: str) -> str:
        """The address ``name`` listens on."""
        service = self.services()[name]
        return f"{address(service.host)}:{service.port}"

    # -- what runs where ----------------------------------------------------------------

    def services(self) -> dict[str, Service]:
        cache = (
            cache_node_services(self.run_dir)
            if self.cache_cluster
            else {"redis": redis_service(self.run_dir)}
        )
        model, kv = self.model, self.kv_transport
        vllm = {
            "p1": vllm_service("p1", "prefill", "0", model, kv),
            "d1": vllm_service("d1", "decode", "1", model, kv),
            "d2": vllm_service("d2", "decode", "0", model, kv),
        }
        gateways = {
            gw: gateway_service(gw, self.run_dir, self.gateway_cores.get(gw)) for gw in GATEWAYS
        }
        return {**cache, **vllm, **gateways, "lb": haproxy_service(self.run_dir)}

    def write_configs(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        (self.run_dir / "pids").mkdir(exist_ok=True)
        (self.run_dir / "policy.toml").write_text(policy(self.redis_url))
        for gw in GATEWAYS:
            config = gateway_config(
                gw, self.run_dir, self.model, self.redis_url, cache_cluster=self.cache_cluster
            )
            (self.run_dir / f"{gw}.toml").write_text(config)
        (self.run_dir / "haproxy.cfg").write_text(haproxy_config(self.run_dir))

    # -- the whole cluster ----------------------------------------------------------------

    def up(self, names: Iterable[str] | None = None) -> None:
        """Build what is missing and start what is not running (all of it by default)."""
        missing = missing_requirements()
        if missing:
            raise ClusterError("cannot build the cluster, missing: " + ", ".join(missing))
        build_tiny_llama(self.model)
        self.write_configs()
        build_network()
        for host in ADDRESSES:
            faults.plug(host)
        order = list(names or [n for n in self.services() if n not in SPARES])
        cache = [n for n in order if self.services()[n].host in CACHE_HOSTS]
        try:
            for name in cache:  # the shared tier first: gateways read it as they start
                self.start(name, wait=False)
            for name in cache:
                self.wait_ready(name)
            if cache:
                self.cache.create()
            for name in order:
                self.start(name, wait=False)
            for name in order:
                self.wait_ready(name)
            if "lb" in order:
                self.lb.wait(len([g for g in GATEWAYS if g in order]))
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Stop every process a pid file names (the LB first), delete the network and the
        gateways' data directories."""
        for name in ("lb", *GATEWAYS, "p1", "d1", *SPARES, "redis"):
            self.stop(name)
        for host in ADDRESSES:
            self.stop(faults.netem_name(host))
        for host in CACHE_HOSTS:
            for port in CACHE_PORTS:
                self.stop(cache_node(host, port))
        shutil.rmtree(self.run_dir / "cache", ignore_errors=True)  # nodes.conf: a new cluster
        remove_network()
        for gw in GATEWAYS:  # their local tiers: a cache of Redis's, rebuilt on the next start
            shutil.rmtree(self.run_dir / gw, ignore_errors=True)

    def status(self) -> dict[str, bool]:
        return {name: self.running(name) for name in self.services()}

    # -- the load balancer and the shared tier (see haproxy.py, redis.py) ----------------

    def wait_lb(self, gateways: int, timeout_s: float = 30.0) -> None:
        """Until the LB sees ``gateways`` gateways up (their health checks passed)."""
        self.lb.wait(gateways, timeout_s)

    def lb_command(self, command: str) -> str:
        """One command on HAProxy's runtime API (e.g. ``disable server gateways/gw2``)."""
        return self.lb.command(command)

    def wait_cache_ok(self, timeout_s: float = 60.0) -> float:
        """Seconds until the shared tier serves every slot again (after a failover, say)."""
        return self.cache.wait_ok(timeout_s)

    def wait_failover(self, key: str, lost: str, timeout_s: float = 60.0) -> float:
        """Seconds until a node other than ``lost`` serves ``key``'s slot as primary."""
        return self.cache.wait_failover(key, lost, timeout_s)

    def cache_primary(self, key: str) -> str:
        """The cache node (service name) that serves ``key``'s slot as primary now."""
        return self.cache.primary(key)

    # -- faults (see faults.py; ``kill`` is the processes') -------------------------------

    def unplug(self, host: str) -> None:
        faults.unplug(host)

    def plug(self, host: str) -> None:
        faults.plug(host)

    def partition(self, host: str, peer: str) -> None:
        faults.partition(host, peer)

    def heal(self, host: str, peer: str) -> None:
        faults.heal(host, peer)

    def impair(
        self, host: str, peers: Sequence[str], delay_ms: float = 200.0, loss: float = 0.05
    ) -> None:
        faults.impair(self, host, peers, delay_ms, loss)

    def repair(self, host: str, peers: Sequence[str]) -> None:
        faults.repair(self, host, peers)
