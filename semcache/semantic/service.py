"""The gateway's semantic cache, built on first use and persisted across restarts.

Loading the encoder takes seconds, so nothing is loaded until a request needs it (a
semantic rule is on, or a classifier model is asked). Then: the encoder, the shipped pair
verifier, the FAISS index restored from its snapshot under ``snapshot_dir``, and, with a
Redis URL, the feed that shares new entries with the other gateways. ``aclose`` writes the
snapshot again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder, load_encoder
from semcache.semantic.feed import RedisEntryFeed
from semcache.semantic.index import IndexSettings, SemanticIndex
from semcache.semantic.records import PartitionKey
from semcache.semantic.verifier import PairVerifier, load_verifier

log = logging.getLogger(__name__)


class SemanticService:
    """Owns the encoder, index, verifier and feed of one gateway (see module docstring)."""

    def __init__(
        self,
        *,
        snapshot_dir: Path | None = None,
        redis_url: str | None = None,
        redis_prefix: str = "semcache",
        encoder_factory: Callable[[], Encoder] = load_encoder,
        verifier_factory: Callable[[], PairVerifier | None] = load_verifier,
        settings: IndexSettings | None = None,
    ) -> None:
        self.snapshot_dir = snapshot_dir
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self._encoder_factory = encoder_factory
        self._verifier_factory = verifier_factory
        self._settings = settings
        self._cache: SemanticCache | None = None
        self._lock = asyncio.Lock()
        self._redis: object | None = None

    @property
    def loaded(self) -> SemanticCache | None:
        """The cache if it was built already (purges need not load it)."""
        return self._cache

    async def get(self) -> SemanticCache:
        """The semantic cache, built (encoder loaded, snapshot restored) on the first call."""
        if self._cache is not None:
            return self._cache
        async with self._lock:
            if self._cache is None:
                self._cache = await self._build()
        return self._cache

    async def encoder(self) -> Encoder:
        return (await self.get()).encoder

    async def _build(self) -> SemanticCache:
        encoder = await asyncio.to_thread(self._encoder_factory)
        try:
            verifier = await asyncio.to_thread(self._verifier_factory)
        except (OSError, ValueError) as exc:
            log.warning("semantic verifier not loaded (%s): rules that need it never hit", exc)
            verifier = None
        settings = self._settings or IndexSettings(dimensions=encoder.dimensions)
        index = SemanticIndex(settings, version=encoder.version)
        feed = None
        if self.redis_url:
            import redis.asyncio as redis_asyncio

            client = redis_asyncio.from_url(self.redis_url)
            self._redis = client
            feed = RedisEntryFeed(client, stream=f"{self.redis_prefix}:semantic:entries")
        cache = SemanticCache(encoder, index, verifier=verifier, feed=feed)
        if self.snapshot_dir is not None:
            report = await cache.load(self.snapshot_dir)
            log.info(
                "semantic index: %d partitions from the snapshot (%s)",
                report.loaded,
                report.stale_reason or "fresh",
            )
        try:
            await cache.start()
        except Exception as exc:  # Redis down: serve from the local index only
            log.warning("semantic feed not started: %s", exc)
        return cache

    async def purge(self, predicate: Callable[[PartitionKey], bool]) -> int:
        """Drop the partitions the predicate selects (no-op before the first use)."""
        if self._cache is None:
            return 0
        return await self._cache.purge(predicate)

    async def snapshot(self) -> None:
        if self._cache is not None and self.snapshot_dir is not None:
            await self._cache.snapshot(self.snapshot_dir)

    async def aclose(self) -> None:
        cache, self._cache = self._cache, None
        if cache is None:
            return
        try:
            if self.snapshot_dir is not None:
                await asyncio.to_thread(cache.index.wait_idle)
                await cache.snapshot(self.snapshot_dir)
        except Exception:
            log.exception("writing the semantic snapshot failed")
        await cache.aclose()
        await cache.encoder.aclose()
        client = self._redis
        if client is not None:
            await client.aclose()  # type: ignore[attr-defined]
