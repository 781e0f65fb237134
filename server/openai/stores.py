"""The stores of the Files and Batch APIs and the owners of stored responses, as the config
asks: on local disk, or in the batch queue's Redis when several gateways share it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from foundation.redis_client import request_path_options
from foundation.redis_replication import ReplicaAck, replica_ack
from server.batch.settings import BatchSettings
from server.openai.batches.redis_store import RedisBatchStore
from server.openai.batches.store import BatchStore, DiskBatchStore
from server.openai.files.redis_store import RedisFileStore
from server.openai.files.store import DiskFileStore, FileStore
from server.openai.responses.owners import ResponseOwners
from server.stores.site import StoreSite, open_site

STORE_TIMEOUT_S = 10.0
"""Longest wait for one reply of the Redis stores (a file of up to ``files.max_bytes`` is one
command)."""


@dataclass
class OpenAIStores:
    files: FileStore
    batches: BatchStore
    responses: ResponseOwners
    site: StoreSite
    """Where they live (closed by :meth:`aclose`)."""
    ack: ReplicaAck | None = None

    async def aclose(self) -> None:
        if self.ack is not None:
            await self.ack.aclose()
        await self.site.aclose()


def uses_redis(settings: BatchSettings) -> bool:
    storage = settings.files.storage
    return storage == "redis" or (storage == "auto" and settings.queue.kind == "redis")


def openai_site(settings: BatchSettings, openai_dir: Path) -> StoreSite:
    """``openai_dir``, or the batch queue's Redis under ``<queue prefix>:openai``."""
    if not uses_redis(settings):
        return StoreSite(openai_dir)
    queue = settings.queue
    # Bounded: a store out of reach is a 503 the client retries, not a hanging request.
    options = request_path_options(STORE_TIMEOUT_S)
    return open_site(openai_dir, queue.redis_url, prefix=f"{queue.prefix}:openai", **options)


def build_stores(settings: BatchSettings, site: StoreSite) -> OpenAIStores:
    """The stores ``settings`` describe on ``site``; no connection is made before their first
    use. Files and batches list a tenant's records and change an index with each, which a
    key-value ``Store`` cannot: they keep their own disk and Redis forms on the site."""
    retention_s = settings.files.retention_s
    client = site.redis
    # On local disk the owners of stored responses have always been kept for good.
    owners = ResponseOwners(
        site.store("resp", folder="responses"),
        retention_s=retention_s if client is not None else None,
    )
    if client is not None:
        queue = settings.queue
        prefix = site.prefix
        ack = replica_ack(
            client, queue.redis_url, replicas=queue.replicas, timeout_s=queue.replica_timeout_s
        )
        return OpenAIStores(
            RedisFileStore(client, prefix=prefix, retention_s=retention_s, ack=ack),
            RedisBatchStore(client, prefix=prefix, retention_s=retention_s, ack=ack),
            owners,
            site,
            ack,
        )
    return OpenAIStores(
        DiskFileStore(site.directory / "files", retention_s=retention_s),
        DiskBatchStore(site.directory / "batches", retention_s=retention_s),
        owners,
        site,
    )
