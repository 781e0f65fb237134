"""Where the key-value stores of one group of features live, chosen once by the app factory:
a local directory, or a Redis under a prefix. Each feature asks for its namespace by name and
gets a Litestar ``Store``; the site closes the Redis client it opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from litestar.stores.base import NamespacedStore
from litestar.stores.registry import StoreRegistry

from foundation.redis_client import RedisClient, open_redis
from server.stores.directory import DirectoryStore
from server.stores.redis import TaggedRedisStore


class StoreSite:
    """Stores by name: ``<directory>/<folder>`` on local disk, or the namespace ``<name>``
    under ``prefix`` in Redis (see ``server/stores/redis.py`` for the key layout)."""

    def __init__(
        self, directory: Path, *, redis: RedisClient | None = None, prefix: str = ""
    ) -> None:
        self.directory = directory
        self.redis = redis
        """The site's client (also for the features whose records do not fit a ``Store``)."""
        self.prefix = prefix
        self._folders: dict[str, str] = {}
        self.registry = StoreRegistry(default_factory=self._make)

    def _make(self, name: str) -> NamespacedStore:
        if self.redis is not None:
            return TaggedRedisStore(self.redis, prefix=self.prefix, namespace=name)
        return DirectoryStore(self.directory / self._folders.get(name, name))

    def store(self, name: str, *, folder: str | None = None) -> NamespacedStore:
        """The store ``name``; ``folder``: its folder on local disk when it is not ``name``
        (a store whose records were laid out before this site)."""
        if folder is not None:
            self._folders[name] = folder
        return cast(NamespacedStore, self.registry.get(name))

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


def open_site(
    directory: Path, redis_url: str | None = None, *, prefix: str = "", **options: Any
) -> StoreSite:
    """The site on ``redis_url`` (client ``options`` as :func:`open_redis` takes them) when
    one is given, else on ``directory``; no connection is made before the first use."""
    if redis_url:
        return StoreSite(directory, redis=open_redis(redis_url, **options), prefix=prefix)
    return StoreSite(directory)
