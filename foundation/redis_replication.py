"""Acknowledged means replicated: wait until replicas hold a write before answering for it.

``WAIT numreplicas timeout`` blocks until the replicas have every write *its own connection*
made. A caller's write goes through a pool (a transaction, on any of its connections), so
:class:`ReplicaAck` writes a small marker key in the same hash slot on one connection and
sends ``WAIT`` right after it, in one non-transactional pipeline: the marker's replication
offset is past the caller's write (the same primary applied it first), so once the replicas
hold the marker they hold the write. On a Redis Cluster the pair goes to the primary that owns
the slot, through a plain client of that node (the cluster pipeline would route a keyless
``WAIT`` to another node). Its clients are its own, with a read timeout longer than the wait.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from foundation.redis_client import CONNECT_TIMEOUT_S, RedisClient, node_client, open_redis

MARKER_TTL_MS = 60_000


class NotReplicated(RedisError):
    """Fewer replicas than asked for confirmed a write in time: it may be lost in a failover."""

    def __init__(self, key: str, wanted: int, acked: int, timeout_s: float) -> None:
        super().__init__(
            f"{acked} of {wanted} replicas confirmed the write to {key!r} within {timeout_s} s"
        )
        self.wanted, self.acked = wanted, acked


def slot_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: its ``{…}`` tag, else the whole key."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


class ReplicaAck:
    """Confirms that ``replicas`` replicas hold every write made so far to a key's slot."""

    def __init__(self, client: RedisClient, url: str, *, replicas: int, timeout_s: float) -> None:
        self.client = client
        """The caller's client (on a cluster: its slot map says which primary owns a key)."""
        self.url = url
        self.replicas = replicas
        self.timeout_s = timeout_s
        # Clients of its own: a read timeout shorter than the WAIT would cut it.
        self._options: dict[str, Any] = {
            "socket_timeout": timeout_s + 5.0,
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
        }
        self._nodes: dict[str, Redis] = {}

    async def confirm(self, key: str) -> int:
        """The replicas that confirmed ``key``'s slot up to now; :class:`NotReplicated` when
        fewer than ``replicas`` did within ``timeout_s`` (0 replicas asked: returns at once)."""
        if self.replicas <= 0:
            return 0
        marker = f"{{{slot_tag(key)}}}:replica-ack"
        name, node = self._node(key)
        try:
            async with node.pipeline(transaction=False) as pipe:
                pipe.set(marker, b"1", px=MARKER_TTL_MS)
                pipe.execute_command("WAIT", self.replicas, max(1, int(self.timeout_s * 1000)))
                _, acked = await pipe.execute()
        except ResponseError as exc:  # MOVED: the slot has another primary since the write
            self._nodes.pop(name, None)
            await node.aclose()
            raise NotReplicated(key, self.replicas, 0, self.timeout_s) from exc
        if int(acked) < self.replicas:
            raise NotReplicated(key, self.replicas, int(acked), self.timeout_s)
        return int(acked)

    def _node(self, key: str) -> tuple[str, Redis]:
        """The client that reaches the primary owning ``key``'s slot, made on first use."""
        if not isinstance(self.client, RedisCluster):
            name = "server"
            if name not in self._nodes:
                self._nodes[name] = open_redis(self.url, **self._options)  # type: ignore[assignment]
            return name, self._nodes[name]
        node = self.client.get_node_from_key(key)
        if node is None:
            raise NotReplicated(key, self.replicas, 0, self.timeout_s)
        if node.name not in self._nodes:
            self._nodes[node.name] = node_client(
                self.url, node.host, int(node.port), **self._options
            )
        return node.name, self._nodes[node.name]

    async def aclose(self) -> None:
        for client in self._nodes.values():
            await client.aclose()
        self._nodes.clear()


def replica_ack(
    client: RedisClient, url: str, *, replicas: int, timeout_s: float
) -> ReplicaAck | None:
    """A :class:`ReplicaAck` when ``replicas`` are asked for, else None (no waiting)."""
    return ReplicaAck(client, url, replicas=replicas, timeout_s=timeout_s) if replicas else None
