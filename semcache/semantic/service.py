"""The gateway's semantic cache, built on first use (or warmed at start) and crash-safe.

Loading the encoder takes seconds, so nothing is loaded until a request needs it (a
semantic rule is on, or a classifier model is asked) or ``warm`` is called. Then: the
encoder, the shipped pair verifier, the FAISS index restored from its snapshot under
``<directory>/snapshot`` and reconciled with the durable records under
``<directory>/records`` (``semcache.semantic.store``), and, with a Redis URL, the feed that
shares new entries with the other gateways (resuming from the last stream id this gateway
applied). A background task writes the snapshot every ``snapshot_interval_s`` when the
index changed, and ``aclose`` writes it once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from foundation.redis_client import CONNECT_TIMEOUT_S, open_redis
from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder
from semcache.semantic.feed import FeedEvent, RedisEntryFeed
from semcache.semantic.index import SemanticIndex
from semcache.semantic.pair_verifier import PairVerifier, load_verifier
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic.records import PartitionKey
from semcache.semantic.store import RecordStore

log = logging.getLogger(__name__)


class SemanticService:
    """Owns the encoder, index, verifier and feed of one gateway (see module docstring)."""

    def __init__(
        self,
        *,
        directory: Path | None = None,
        redis_url: str | None = None,
        redis_prefix: str = "semcache",
        max_bytes: int = 2 * 1024**3,
        snapshot_interval_s: float = 300.0,
        tick_s: float = 2.0,
        encoder_factory: Callable[[], Encoder],
        verifier_factory: Callable[[], PairVerifier | None] = load_verifier,
        settings: IndexSettings | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.directory = directory
        """None: no persistence at all (the index lives in memory)."""
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.max_bytes = max_bytes
        self.snapshot_interval_s = snapshot_interval_s
        self.tick_s = tick_s
        """How often the background task saves the feed cursor and checks the snapshot."""
        self._encoder_factory = encoder_factory
        self._verifier_factory = verifier_factory
        self._settings = settings
        self._cache: SemanticCache | None = None
        self._lock = asyncio.Lock()
        self._redis: object | None = None
        self._store: RecordStore | None = None
        self._feed: RedisEntryFeed | None = None
        self._background: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[SemanticCache] | None = None
        self.snapshots_written = 0
        self.write_failures = (
            Counter(
                "semcache_semantic_record_write_failures",
                "Semantic records that could not be written (a full disk): served from "
                "memory, dropped at the next start",
                registry=registry,
            )
            if registry is not None
            else None
        )
        self.feed_records = (
            Counter(
                "semcache_semantic_feed_records",
                "Semantic entries this gateway published to the shared feed, or received "
                "from the other gateways through it",
                ["direction"],
                registry=registry,
            )
            if registry is not None
            else None
        )
        self.feed_errors = (
            Counter(
                "semcache_semantic_feed_errors",
                "Failed feed operations: a publish (its entries stay local; the other "
                "gateways miss them) or a read (retried from the same stream id)",
                ["op"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def _observe_feed(self, event: FeedEvent, count: int) -> None:
        if self.feed_records is None or self.feed_errors is None:
            return
        if event == "published" or event == "received":
            self.feed_records.labels(event).inc(count)
        else:
            self.feed_errors.labels("publish" if event == "publish_failed" else "read").inc()

    @property
    def snapshot_dir(self) -> Path | None:
        return self.directory / "snapshot" if self.directory is not None else None

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

    def warm(self) -> None:
        """Build the cache in the background now (catch up on the feed before any request)."""
        if self._cache is None and self._warming is None:
            self._warming = asyncio.create_task(self.get(), name="semantic-warm")
            self._warming.add_done_callback(_log_failure)

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
        store = None
        if self.directory is not None:
            store = await asyncio.to_thread(
                RecordStore, self.directory / "records", max_bytes=self.max_bytes
            )
            self._store = store
        feed = None
        if self.redis_url:
            client = open_redis(self.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
            self._redis = client
            cursor = await asyncio.to_thread(store.cursor) if store is not None else None
            feed = RedisEntryFeed(
                client,
                stream=f"{self.redis_prefix}:semantic:entries",
                replay=True,  # a new gateway warms its index from what the stream holds
                start_id=cursor,
                observer=self._observe_feed,
            )
            self._feed = feed
        cache = SemanticCache(encoder, index, verifier=verifier, feed=feed, store=store)
        if self.write_failures is not None:
            cache.on_persist_failure = self.write_failures.inc
        if self.snapshot_dir is not None:
            report = await cache.load(self.snapshot_dir)
            log.warning(
                "semantic index: %d partitions from the snapshot (%s), %d rebuilt, "
                "%d records added, %d entries dropped",
                report.loaded,
                report.stale_reason or "fresh",
                report.rebuilt,
                report.records_added,
                report.dropped,
            )
        try:
            await cache.start()
        except Exception as exc:  # Redis down: serve from the local index only
            log.warning("semantic feed not started: %s", exc)
        if store is not None:
            self._background = asyncio.create_task(
                self._persist_loop(cache, store), name="semantic-persist"
            )
        return cache

    async def _persist_loop(self, cache: SemanticCache, store: RecordStore) -> None:
        """Save the feed cursor every tick; write the snapshot every interval if changed."""
        saved_cursor: str | None = None
        snapshot_changes = cache.changes
        last_snapshot = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                feed = self._feed
                if feed is not None and feed.last_id and feed.last_id != saved_cursor:
                    saved_cursor = feed.last_id
                    await asyncio.to_thread(store.set_cursor, saved_cursor)
                now = asyncio.get_running_loop().time()
                due = self.snapshot_interval_s > 0 and now - last_snapshot >= (
                    self.snapshot_interval_s
                )
                if due and cache.changes != snapshot_changes and self.snapshot_dir is not None:
                    snapshot_changes = cache.changes
                    last_snapshot = now
                    await cache.snapshot(self.snapshot_dir)
                    self.snapshots_written += 1
            except Exception:
                log.exception("semantic persistence tick failed")

    async def purge(self, predicate: Callable[[PartitionKey], bool]) -> int:
        """Drop the partitions the predicate selects (before the first use: their records)."""
        if self._cache is not None:
            return await self._cache.purge(predicate)
        records = self.directory / "records" if self.directory is not None else None
        if records is None or not records.is_dir():
            return 0

        def purge_records() -> int:
            store = RecordStore(records, max_bytes=self.max_bytes)
            try:
                return store.delete_partitions(predicate)
            finally:
                store.close()

        return await asyncio.to_thread(purge_records)

    async def snapshot(self) -> None:
        if self._cache is not None and self.snapshot_dir is not None:
            await self._cache.snapshot(self.snapshot_dir)

    async def aclose(self) -> None:
        warming, self._warming = self._warming, None
        if warming is not None and not warming.done():
            warming.cancel()
            with contextlib.suppress(BaseException):
                await warming
        background, self._background = self._background, None
        if background is not None:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
        cache, self._cache = self._cache, None
        if cache is None:
            return
        await cache.aclose()  # the feed stops first: nothing changes while writing
        try:
            if self.snapshot_dir is not None:
                await asyncio.to_thread(cache.index.wait_idle)
                await cache.snapshot(self.snapshot_dir)
            feed, store = self._feed, self._store
            if feed is not None and store is not None and feed.last_id:
                await asyncio.to_thread(store.set_cursor, feed.last_id)
        except Exception:
            log.exception("writing the semantic snapshot failed")
        await cache.encoder.aclose()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None
        client = self._redis
        if client is not None:
            await client.aclose()  # type: ignore[attr-defined]


def _log_failure(task: asyncio.Task[SemanticCache]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warming the semantic cache failed", exc_info=task.exception())
