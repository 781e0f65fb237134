"""The one place that builds a Redis client: single-node Redis/Valkey or a Redis Cluster.

A URL whose scheme ends in ``+cluster`` (``redis+cluster://host:port[,host:port…]``,
``rediss+cluster://…``, ``valkey+cluster://…``) selects redis-py's
:class:`redis.asyncio.cluster.RedisCluster`; the listed hosts are its startup nodes and it
learns the rest of the cluster from them. Any other URL gives a plain
:class:`redis.asyncio.Redis`, exactly as before.

On a cluster, keys a script, a transaction or a stream touch together must share a slot:
:func:`hash_tag` wraps a key family's prefix in ``{…}`` so all its keys do. Classic pub/sub
works unchanged on a cluster (a ``PUBLISH`` reaches subscribers on every node), once the
client knows the slots: :func:`ready_for_pubsub` makes it learn them first.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RedisClient = Redis | RedisCluster
"""What :func:`open_redis` returns; both speak the same command API."""

_CLUSTER_SUFFIX = "+cluster"

UNREACHABLE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    RedisClusterException,  # no node of the cluster reached, a slot no node serves
    ClusterDownError,  # a failover in progress, or a node that still counts another as failed
    TryAgainError,  # a slot being resharded or a failover's keys not settled yet
)
"""What a client raises while the store cannot serve it (down, partitioned, a cluster not
settled): an outage to wait out, never a wrong command."""


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (its scheme ends in ``+cluster``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.endswith(_CLUSTER_SUFFIX)


def startup_nodes(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` pairs a cluster URL lists (``host:port,host:port``; 6379 default)."""
    _, _, rest = url.partition("://")
    hosts = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    nodes: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "6379")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"no cluster nodes in {url!r}")
    return nodes


def _credentials(url: str) -> dict[str, Any]:
    _, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0]
    if "@" not in netloc:
        return {}
    user, _, password = netloc.rsplit("@", 1)[0].partition(":")
    out: dict[str, Any] = {"password": password or user}
    if password and user:
        out["username"] = user
    return out


CONNECT_TIMEOUT_S = 2.0
"""How long opening a connection to a Redis node may take before it counts as out of reach:
a dead host or a partition drops the handshake silently, and without a bound the kernel's
retries hold a request for about two minutes."""


def request_path_options(timeout_s: float) -> dict[str, Any]:
    """Client options for a store a request waits on: connections and replies bounded, and
    two retries after a lost connection (a failover) instead of redis-py's ten, so one
    request is answered (or refused, 503) within seconds, not half a minute."""
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": timeout_s,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 2),
    }


def open_redis(url: str, **options: Any) -> RedisClient:
    """A client for ``url``; ``options`` (timeouts, retry, decode_responses) go to it as given.

    No connection is made before the first command.
    """
    if not is_cluster_url(url):
        return Redis.from_url(url, **options)
    scheme = url.partition("://")[0]
    nodes = [ClusterNode(host, port) for host, port in startup_nodes(url)]
    if scheme.startswith("rediss") or scheme.startswith("valkeys"):
        options.setdefault("ssl", True)
    return RedisCluster(startup_nodes=nodes, **_credentials(url), **options)


def node_client(url: str, host: str, port: int, **options: Any) -> Redis:
    """A plain client of one node of the cluster ``url`` names (its credentials and TLS)."""
    if url.partition("://")[0].startswith(("rediss", "valkeys")):
        options.setdefault("ssl", True)
    return Redis(host=host, port=port, **_credentials(url), **options)


async def ready_for_pubsub(client: RedisClient) -> RedisClient:
    """``client``, ready to subscribe: a cluster client learns the slot map first.

    redis-py's cluster pub/sub picks the node to subscribe on from the slot map, which a
    fresh client fills only on its first command; without this ``SUBSCRIBE`` fails.
    """
    if isinstance(client, RedisCluster):
        await client.initialize()
    return client


def single_node_url(url: str) -> str:
    """``url`` with ``+cluster`` dropped from its scheme (for libraries that take a URL)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme.removesuffix(_CLUSTER_SUFFIX)}{sep}{rest}"


def hash_tag(prefix: str) -> str:
    """``prefix`` as a Redis Cluster hash tag, so every ``<tag>:…`` key shares one slot.

    A prefix that already holds a tag is returned as it is.
    """
    if "{" in prefix and "}" in prefix.split("{", 1)[1]:
        return prefix
    return f"{{{prefix}}}"
