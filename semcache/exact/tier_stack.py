"""The exact cache's tiers, walked top-down: L1 memory → L2 disk → L3 Redis.

L1 holds verified, decoded entries. An entry read from a byte tier is checked against its
checksum, and a failing one is deleted, counted and treated as absent. A hit in a lower tier
is copied into the tiers above it (backfill). Writes to the local disk tier may run behind,
batched off the request path; Redis is always written through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import msgspec

from foundation import tracing as spans
from semcache.entry import CachedAnswer, IntegrityError, decode_entry, encode_entry
from semcache.exact.freshness import freshness
from semcache.exact.request import CacheRequest, CacheStatus
from semcache.exact.tier_errors import TierErrors
from semcache.metrics import CacheMetrics
from semcache.tiers import DiskStore, MemoryStore, Store

log = logging.getLogger("semcache.exact")


class Found(msgspec.Struct):
    """A servable entry the walk found, and where."""

    entry: CachedAnswer
    index: int
    """The tier it was found in (0 is the top)."""
    status: CacheStatus
    age_s: float
    blob: bytes | None
    """Its encoded bytes when read from a byte tier (reused for the backfill)."""


class TierStack:
    """An optional memory tier over byte tiers (disk, Redis)."""

    def __init__(
        self,
        memory: MemoryStore[CachedAnswer] | None,
        lower: Sequence[Store[bytes]],
        *,
        metrics: CacheMetrics | None = None,
        write_behind: bool = False,
    ) -> None:
        self.memory = memory
        self.lower = list(lower)
        self.metrics = metrics
        self.write_behind = write_behind
        self.closed = False
        """Set when the cache closes: from then on the disk tier is written through."""
        self.errors = TierErrors(metrics)
        for store in self.lower:
            if isinstance(store, DiskStore):
                store.report_writes(partial(self.errors.disk_wrote, store))

    def __len__(self) -> int:
        return len(self.lower) + (1 if self.memory is not None else 0)

    @property
    def names(self) -> list[str]:
        return [*(["memory"] if self.memory is not None else []), *(s.tier for s in self.lower)]

    def store_at(self, i: int) -> Store[Any]:
        if self.memory is not None:
            return self.memory if i == 0 else self.lower[i - 1]
        return self.lower[i]

    # ------------------------------------------------------------------ read

    async def read(self, i: int, digest: str) -> tuple[CachedAnswer | None, bytes | None]:
        """The entry tier ``i`` holds under ``digest`` (verified), and its bytes if encoded."""
        if self.memory is not None and i == 0:
            return await self.memory.get(digest), None
        store = self.lower[i - (1 if self.memory is not None else 0)]
        try:
            blob = await store.get(digest)
        except Exception as exc:  # a broken tier is a miss, never a failed request
            self.errors.failed(store, "get", exc)
            return None, None
        self.errors.worked(store, "get")
        if blob is None:
            return None, None
        try:
            return decode_entry(blob, digest), blob
        except IntegrityError as exc:
            log.warning("dropping corrupt cache entry %s in %s: %s", digest[:12], store.tier, exc)
            if self.metrics:
                self.metrics.integrity_failures.labels(store.tier).inc()
            await self._delete(store, digest)
            return None, None

    async def find(
        self, req: CacheRequest, now: float, *, traced: bool = False
    ) -> tuple[Found | None, bool]:
        """Best servable entry walking down the tiers; also whether an expired one was seen.

        A fresh entry ends the walk. A stale one is kept while the lower tiers are asked for
        a fresh one (another worker or gateway may have refreshed it already). A purged one
        is deleted from its tier. ``traced``: each tier's read is a span of the request's trace.
        """
        expired = False
        stale: Found | None = None
        for i in range(len(self)):
            if traced:
                entry, blob = await self._traced_read(i, req.key.digest)
            else:
                entry, blob = await self.read(i, req.key.digest)
            if entry is None:
                continue
            if req.epochs.purged(req.key.short_id, entry.tags, entry.epochs):
                store = self.store_at(i)
                if self.metrics:
                    self.metrics.purged_reads.labels(store.tier).inc()
                await self._delete(store, req.key.digest)
                continue
            status, age = freshness(entry, req.control, now)
            if status is CacheStatus.EXPIRED:
                expired = True
                continue
            found = Found(entry=entry, index=i, status=status, age_s=age, blob=blob)
            if status is CacheStatus.HIT:
                return found, expired
            if stale is None or entry.created_at > stale.entry.created_at:
                stale = found
        return stale, expired

    async def _traced_read(self, i: int, digest: str) -> tuple[CachedAnswer | None, bytes | None]:
        with spans.span("cache.tier", {"semcache.tier": self.store_at(i).tier}) as span:
            entry, blob = await self.read(i, digest)
            if span is not None:
                span.set_attribute("semcache.hit", entry is not None)
        return entry, blob

    async def backfill(self, req: CacheRequest, found: Found, now: float) -> None:
        """Copy an entry found in a lower tier into the tiers above it, for its remaining life."""
        entry = found.entry
        remaining = entry.created_at + entry.ttl_s + entry.swr_s - now
        if remaining <= 0:
            return
        blob = found.blob
        for i in range(found.index):
            store = self.store_at(i)
            if store is self.memory:
                await self.memory.set(req.key.digest, entry, remaining)
                continue
            if blob is None:
                blob = encode_entry(entry, req.key.digest)
            await self._write(store, req.key.digest, blob, remaining)

    # ------------------------------------------------------------------ write

    async def store(
        self, digest: str, entry: CachedAnswer, life_s: float, *, through: bool = False
    ) -> None:
        """Store ``entry`` in every tier for ``life_s`` seconds.

        ``through``: return only once every tier holds it, even when the disk tier writes
        behind.
        """
        if self.memory is not None:
            await self.memory.set(digest, entry, life_s)
        if self.lower:
            blob = encode_entry(entry, digest)
            writes = [self._write(s, digest, blob, life_s, through=through) for s in self.lower]
            if len(writes) == 1:
                await writes[0]  # no task for one tier (the disk tier, usually writing behind)
            else:
                await asyncio.gather(*writes)
        if self.metrics and self.memory is not None:
            self.metrics.bytes_stored.labels("memory").inc(entry.payload_bytes)

    async def _set(self, store: Store[bytes], key: str, blob: bytes, ttl_s: float) -> None:
        try:
            await store.set(key, blob, ttl_s)
        except Exception as exc:
            if not isinstance(store, DiskStore):  # the disk tier reports its own batches
                self.errors.failed(store, "set", exc)
            return
        self.errors.worked(store, "set")
        if self.metrics:
            self.metrics.bytes_stored.labels(store.tier).inc(len(blob))

    async def _write(
        self, store: Store[bytes], key: str, blob: bytes, ttl_s: float, *, through: bool = False
    ) -> None:
        """Write through, or in the background for the disk tier when writing behind."""
        if through or not self.write_behind or self.closed or not isinstance(store, DiskStore):
            await self._set(store, key, blob, ttl_s)
            return
        # Batched with the writes around it, off the request path (see DiskStore.set_behind).
        store.set_behind(key, blob, ttl_s)
        if self.metrics:
            self.metrics.bytes_stored.labels(store.tier).inc(len(blob))

    async def flush(self) -> None:
        """Commit the background writes started so far."""
        for store in self.lower:
            if isinstance(store, DiskStore):
                try:
                    await store.flush()
                except Exception as exc:
                    self.errors.failed(store, "set", exc)

    async def _delete(self, store: Store[Any], key: str) -> None:
        try:
            await store.delete(key)
        except Exception as exc:
            self.errors.failed(store, "delete", exc)

    async def aclose(self) -> None:
        """Close the byte tiers (after :meth:`flush`)."""
        for s in self.lower:
            await s.aclose()
