"""L2: a size-limited ``diskcache`` directory shared by the worker processes of one machine.

diskcache is SQLite plus files and is safe across processes; its calls block, so each runs in
a worker thread. A lock held too long by another process (``diskcache.Timeout``) counts as a
miss or a skipped write rather than an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Self

import diskcache

from semcache.tiers.base import Store

log = logging.getLogger(__name__)


class DiskStore(Store[bytes]):
    """Byte store on a ``diskcache.Cache``; ``max_bytes`` bounds the directory's size."""

    tier = "disk"

    def __init__(
        self,
        directory: str | Path,
        *,
        max_bytes: int = 1024**3,
        eviction: str = "least-recently-stored",
        timeout_s: float = 2.0,
        namespace: str = "",
        _cache: diskcache.Cache | None = None,
    ) -> None:
        super().__init__(namespace)
        self.directory = Path(directory)
        self._cache = _cache or diskcache.Cache(
            str(self.directory),
            size_limit=max_bytes,
            eviction_policy=eviction,
            timeout=timeout_s,
        )

    @property
    def cache(self) -> diskcache.Cache:
        return self._cache

    def _get(self, key: str) -> bytes | None:
        try:
            value = self._cache.get(key, default=None, retry=False)
        except diskcache.Timeout:
            return None
        return value if isinstance(value, bytes) else None

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._get, self._full(key))

    def _set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        try:
            self._cache.set(key, value, expire=ttl_s, retry=False)
        except diskcache.Timeout:
            log.debug("disk tier busy, write of %s skipped", key)

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            return
        await asyncio.to_thread(self._set, self._full(key), value, ttl_s)

    def _delete_many(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self._cache.delete(k, retry=True)
            except diskcache.Timeout:
                log.warning("disk tier busy, delete of %s skipped", k)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._delete_many, [self._full(key)])

    async def delete_many(self, keys: Iterable[str]) -> None:
        await asyncio.to_thread(self._delete_many, [self._full(k) for k in keys])

    def _clear(self) -> None:
        if not self.namespace:
            self._cache.clear(retry=True)
            return
        prefix = self.namespace + "/"
        self._delete_many([k for k in self._cache.iterkeys() if str(k).startswith(prefix)])

    async def clear(self) -> None:
        await asyncio.to_thread(self._clear)

    def with_namespace(self, namespace: str) -> Self:
        return type(self)(self.directory, namespace=self._child(namespace), _cache=self._cache)

    @property
    def volume(self) -> int:
        """Bytes used on disk (blocking; for tests and stats)."""
        return int(self._cache.volume())

    async def aclose(self) -> None:
        await asyncio.to_thread(self._cache.close)
