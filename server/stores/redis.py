"""Litestar's ``RedisStore`` with keys laid out for a Redis Cluster.

Under the site's prefix ``P`` and the store's namespace ``N``, the key ``<tag>/<rest>`` is
``P:{<tag>}:N:<rest>`` (the tag, a tenant's hash, is a Redis Cluster hash tag: a tenant's
keys of every store share one slot) and a key without ``/`` is ``P:N:<key>``. Expiries are
kept to the millisecond.
"""

from __future__ import annotations

from datetime import timedelta
from typing import cast

from litestar.stores.redis import RedisStore
from redis.asyncio import Redis

from foundation.redis_client import RedisClient


def _ms(expires_in: int | timedelta) -> int:
    seconds = expires_in.total_seconds() if isinstance(expires_in, timedelta) else expires_in
    return max(1, int(seconds * 1000))


class TaggedRedisStore(RedisStore):
    """A namespace of the Redis ``client`` under ``prefix``; the client is the site's (it
    closes it)."""

    def __init__(self, client: RedisClient, *, prefix: str, namespace: str) -> None:
        # A cluster client speaks the commands this store sends (one key each).
        super().__init__(cast(Redis, client), namespace=namespace, handle_client_shutdown=False)
        self.prefix = prefix
        self.client = client

    def with_namespace(self, namespace: str) -> TaggedRedisStore:
        return TaggedRedisStore(
            self.client, prefix=self.prefix, namespace=f"{self.namespace}:{namespace}"
        )

    def _make_key(self, key: str) -> str:
        tag, slash, rest = key.partition("/")
        if slash:
            return f"{self.prefix}:{{{tag}}}:{self.namespace}:{rest}"
        return f"{self.prefix}:{self.namespace}:{key}"

    async def set(
        self, key: str, value: str | bytes, expires_in: int | timedelta | None = None
    ) -> None:
        data = value.encode() if isinstance(value, str) else value
        px = _ms(expires_in) if expires_in is not None else None
        await self.client.set(self._make_key(key), data, px=px)

    async def delete_all(self) -> None:
        """Remove every key of this namespace and its children (a scan of every node)."""
        for pattern in (
            f"{self.prefix}:{self.namespace}:*",
            f"{self.prefix}:{{*}}:{self.namespace}:*",
        ):
            async for key in self.client.scan_iter(match=pattern):
                await self.client.unlink(key)

    async def expires_in(self, key: str) -> int | None:
        ttl = await self.client.ttl(self._make_key(key))
        return None if ttl < 0 else int(ttl)
