"""The stores of the Files and Batch APIs and the owners of stored responses, as the config
asks: on local disk, or in the batch queue's Redis when several gateways share it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from foundation.redis_client import RedisClient, open_redis, request_path_options
from foundation.redis_replication import ReplicaAck, replica_ack
from server.batch.settings import BatchSettings
from server.openai.batches.redis_store import RedisBatchStore
from server.openai.batches.store import BatchStore, DiskBatchStore
from server.openai.files.redis_store import RedisFileStore
from server.openai.files.store import DiskFileStore, FileStore
from server.openai.responses.owners import DiskResponseOwners, ResponseOwners
from server.openai.responses.redis_owners import RedisResponseOwners

STORE_TIMEOUT_S = 10.0
"""Longest wait for one reply of the Redis stores (a file of up to ``files.max_bytes`` is one
command)."""


@dataclass
class OpenAIStores:
    files: FileStore
    batches: BatchStore
    responses: ResponseOwners
    redis: RedisClient | None = None
    """The client of the Redis stores (closed by :meth:`aclose`)."""
    ack: ReplicaAck | None = None

    async def aclose(self) -> None:
        if self.ack is not None:
            await self.ack.aclose()
        if self.redis is not None:
            await self.redis.aclose()


def uses_redis(settings: BatchSettings) -> bool:
    storage = settings.files.storage
    return storage == "redis" or (storage == "auto" and settings.queue.kind == "redis")


def build_stores(settings: BatchSettings, openai_dir: Path) -> OpenAIStores:
    """The stores ``settings`` describe; no connection is made before their first use."""
    retention_s = settings.files.retention_s
    if uses_redis(settings):
        queue = settings.queue
        # Bounded: a store out of reach is a 503 the client retries, not a hanging request.
        client = open_redis(queue.redis_url, **request_path_options(STORE_TIMEOUT_S))
        prefix = f"{queue.prefix}:openai"
        ack = replica_ack(
            client, queue.redis_url, replicas=queue.replicas, timeout_s=queue.replica_timeout_s
        )
        return OpenAIStores(
            RedisFileStore(client, prefix=prefix, retention_s=retention_s, ack=ack),
            RedisBatchStore(client, prefix=prefix, retention_s=retention_s, ack=ack),
            RedisResponseOwners(client, prefix=prefix, retention_s=retention_s),
            client,
            ack,
        )
    return OpenAIStores(
        DiskFileStore(openai_dir / "files", retention_s=retention_s),
        DiskBatchStore(openai_dir / "batches", retention_s=retention_s),
        DiskResponseOwners(openai_dir / "responses"),
    )
