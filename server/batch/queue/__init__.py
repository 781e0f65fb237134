"""Durable queues of batch work: SQLite on one machine (``disk``), Redis Streams across
gateways (``redis``); ``base`` is the contract both keep."""

from __future__ import annotations

from pathlib import Path

from server.batch.queue.base import BatchQueue
from server.batch.queue.disk import DiskQueue
from server.batch.queue.redis import RedisQueue
from server.batch.settings import QueueSettings


async def open_queue(settings: QueueSettings, data_dir: Path) -> BatchQueue:
    """The queue ``settings`` describe; the disk queue defaults to ``data_dir/queue/``."""
    common = {
        "lease_s": settings.lease_s,
        "results_ttl_s": settings.results_ttl_s,
        "max_age_s": settings.max_age_s,
    }
    if settings.kind == "redis":
        return await RedisQueue.open(
            settings.redis_url,
            prefix=settings.prefix,
            replicas=settings.replicas,
            replica_timeout_s=settings.replica_timeout_s,
            **common,
        )
    path = Path(settings.path) if settings.path else data_dir / "queue" / "batch.sqlite3"
    return await DiskQueue.open(path.expanduser(), **common)
