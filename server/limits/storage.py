"""Opening the `limits` library's storage: in-process memory, or Redis shared by gateways."""

from __future__ import annotations

from typing import Any, cast

from limits.aio.storage import Storage
from limits.errors import StorageError
from limits.storage import storage_from_string
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from foundation.redis_client import RedisClient, is_cluster_url, open_redis
from semcache.tiers.redis import OUTAGE_ERRORS

STORAGE_FAILURES: tuple[type[BaseException], ...] = (StorageError, *OUTAGE_ERRORS)
"""What an unreachable storage raises."""


def open_storage(
    uri: str, *, prefix: str = "semcache:limits", timeout_s: float = 0.25
) -> tuple[Storage, RedisClient | None]:
    """The `limits` storage for ``uri`` (``async+memory://``, ``async+redis://host:port/db``
    or ``async+redis+cluster://host:port,…``) and a Redis client on the same Redis for the
    budget reservations, which the caller closes (on one node it owns the storage's pool).

    Redis gets short socket timeouts and no retries, so an outage costs one timeout, then the
    breaker keeps requests off it.
    """
    if not uri.startswith(("async+redis", "async+valkey")):
        return cast(Storage, storage_from_string(uri)), None
    if is_cluster_url(uri):  # limits builds its own RedisCluster; its keys carry hash tags
        storage = storage_from_string(
            uri,
            implementation="redispy",
            key_prefix=prefix,
            wrap_exceptions=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        client = open_redis(
            uri.removeprefix("async+"),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cast(Storage, storage), client
    pool = ConnectionPool.from_url(
        uri.removeprefix("async+"),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    options: dict[str, Any] = {"connection_pool": pool}
    storage = storage_from_string(
        uri, implementation="redispy", key_prefix=prefix, wrap_exceptions=True, **options
    )
    return cast(Storage, storage), Redis.from_pool(pool)
