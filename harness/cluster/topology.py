"""The cluster's hosts: names, addresses, ports, and what its clients need to know.

Each host is a network namespace (``sc-<host>``) with one interface, ``eth0``, plugged into
a bridge that lives in a namespace of its own (``sc-switch``); the machine itself joins the
bridge as the client (``10.77.0.1``, interface ``sc-client``), so tests and benchmarks reach
every host, and nothing is routed beyond the subnet (no host has a default route):

=======  ============  ==================================================================
host     address       runs
=======  ============  ==================================================================
lb       10.77.0.10    HAProxy on :8080, health-checking the gateways' ``/ready``
gw1      10.77.0.11    ``semcache serve --no-launch`` on :8080
gw2      10.77.0.12    the same, same config but for its address and data directory
redis    10.77.0.20    redis-server on :6379 (no persistence): the L3 tier, purge epochs,
                       the batch queue
c1-c3    10.77.0.21-23 with ``cache_cluster`` (``--cache-cluster``), instead of ``redis``:
                       Redis Cluster nodes on :6379, :6380 and :6381 each; three primaries
                       with two replicas each, every copy of a slot on another host
p1       10.77.0.31    vLLM prefill (NixlConnector producer) on :8000, pinned to core 0
d1       10.77.0.32    vLLM decode (NixlConnector consumer) on :8000, pinned to core 1
d2       10.77.0.33    a second decode server, a spare: not started by ``up``, not in the
                       gateways' config (a test starts it and adds it through the admin API)
=======  ============  ==================================================================
"""

from __future__ import annotations

from typing import Literal

KvTransport = Literal["tcp", "shm"]
"""How the KV moves from p1 to d1: TCP over the veth pairs, or shared memory (the baseline)."""

SUBNET = "10.77.0"
CLIENT_ADDRESS = f"{SUBNET}.1"
PREFIX = "sc-"
ADDRESSES = {
    "lb": 10,
    "gw1": 11,
    "gw2": 12,
    "redis": 20,
    "c1": 21,
    "c2": 22,
    "c3": 23,
    "p1": 31,
    "d1": 32,
    "d2": 33,
}
SPARES = ("d2",)
"""Services ``up`` leaves stopped unless named."""
CACHE_HOSTS = ("c1", "c2", "c3")
"""With ``cache_cluster``: the hosts of the replicated shared tier, a Redis Cluster of three
primaries with two replicas each, every copy of a slot on another host. Two, not one: a
shard whose primary is lost still has a replica behind the promoted one, so writes that wait
for a replica (``replicas = 1``) are acknowledged again once the failover is over, instead of
being refused until the lost node is back."""
CACHE_PORTS = (6379, 6380, 6381)
GATEWAYS = ("gw1", "gw2")
GATEWAY_PORT = 8080
LB_PORT = 8080
LB_STATS_PORT = 8404
REDIS_PORT = 6379
VLLM_PORT = 8000
NIXL_PORT = 5600

TOKEN = "cluster-admin-token"
"""The bearer token of the gateways' one tenant (``cluster``, admin role)."""
METERED_TOKEN = "cluster-metered-token"
"""A second tenant's token with a per-minute request limit, counted in the Redis host."""
METERED_RPM = 8
MODEL_ID = "tiny-chat"
SEMANTIC_MODEL_ID = "tiny-semantic"
"""The same backend with the semantic cache on for chat (the policy's only semantic rule)."""
WORKERS_AI_MODEL = "@cf/test/tiny"
HOST_HEADER = "x-cluster-host"
"""Sent to the LB: pins the request to that gateway (while it is up). Answered by the LB:
the gateway that served the request."""


class ClusterError(RuntimeError):
    """The cluster could not be built or a host did not come up; carries a log tail."""


def address(host: str) -> str:
    return f"{SUBNET}.{ADDRESSES[host]}"


def namespace(host: str) -> str:
    return f"{PREFIX}{host}"


def host_of(ip: str) -> str:
    """The host at address ``ip``."""
    return next(h for h in ADDRESSES if address(h) == ip)


def cache_node(host: str, port: int) -> str:
    """The service name of the cache node on ``host``:``port``."""
    return f"{host}-{port}"
