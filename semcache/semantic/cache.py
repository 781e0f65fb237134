"""The semantic cache: encode, search one partition, optionally verify, per input item.

The cache stores no answers: an entry points (``payload_ref``) to the answer the caller
keeps in the exact tiers. A lookup returns, for each input text, the best cached entry
that passes the rule's threshold (and the verifier, when the rule asks for it), or None
(``semcache.semantic.match``); a verified partition's lookup also decides whether to serve
or explore (``semcache.semantic.verified.lookup``). Inserts, observations and removals are
kept durably in the record store and published to the other gateways through the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from semcache.semantic.encoder import Encoder
from semcache.semantic.feed import EntryFeed
from semcache.semantic.index import LoadReport, SemanticIndex
from semcache.semantic.match import Match, best_matches, effective_threshold
from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.partition_types import Limits
from semcache.semantic.reconcile import reconcile
from semcache.semantic.records import PartitionKey, SemanticRecord, vector_bytes
from semcache.semantic.store import RecordStore
from semcache.semantic.verified.decisions import Decision, Observation
from semcache.semantic.verified.lookup import (
    ExploreBudget,
    verified_candidate,
    verified_params,
)
from semcache.semantic_settings import SemanticRule

log = logging.getLogger(__name__)


def limits_of(rule: SemanticRule) -> Limits:
    return Limits(ann_after=rule.ann_after, max_entries=rule.max_entries)


class SemanticCache:
    """Semantic lookups and inserts over hard partitions (see module docstring)."""

    def __init__(
        self,
        encoder: Encoder,
        index: SemanticIndex,
        *,
        verifier: PairVerifier | None = None,
        feed: EntryFeed | None = None,
        store: RecordStore | None = None,
        maintenance_interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self.encoder = encoder
        self.index = index
        self.verifier = verifier
        self.feed = feed
        self.store = store
        """The durable records (None: the index lives in memory and snapshots only)."""
        self.maintenance_interval_s = maintenance_interval_s
        self.clock = clock
        self.uniform = uniform
        """Draws from U[0, 1) for the verified decisions (seeded in tests)."""
        self.changes = 0
        """Counts inserts and removals, so a periodic snapshot can skip an unchanged index."""
        self.on_persist_failure: Callable[[int], None] | None = None
        """Told how many records a failed write lost (a full disk); the service counts them."""
        self._persist_failing = False
        self._explores = ExploreBudget()
        self._maintenance: asyncio.Task[None] | None = None

    @property
    def matcher_version(self) -> str:
        """Encoder and verifier versions; part of every partition key."""
        verifier = self.verifier.version if self.verifier is not None else "none"
        return f"{self.encoder.version}+{verifier}"

    def partition_key(
        self, *, scope: str, model_revision: str, task: str, template: str
    ) -> PartitionKey:
        """The partition of a request (the caller supplies the exact cache's key parts)."""
        return PartitionKey(
            scope=scope,
            model_revision=model_revision,
            task=task,
            template=template,
            matcher=self.matcher_version,
        )

    async def encode(self, texts: Sequence[str]) -> np.ndarray:
        return await self.encoder.encode(texts)

    async def lookup(
        self,
        partition: PartitionKey,
        texts: Sequence[str],
        rule: SemanticRule,
        tighten_threshold: float | None = None,
        *,
        vectors: np.ndarray | None = None,
    ) -> list[Match | None]:
        """For each text, the cached entry to serve, or None (one result per text, in order).

        Pass ``vectors`` (from ``encode``) to avoid encoding twice when inserting after a miss.
        """
        if not rule.enabled or not texts:
            return [None] * len(texts)
        if rule.verifier and self.verifier is None:
            log.warning("rule asks for the verifier but none is loaded: no semantic hits")
            return [None] * len(texts)
        if vectors is None:
            vectors = await self.encoder.encode(texts)
        threshold = effective_threshold(rule, tighten_threshold)
        use_verifier = rule.verifier and self.verifier is not None
        k = max(1, rule.candidates) if use_verifier else 1
        now = self.clock()
        verifier = self.verifier if use_verifier else None

        def decide() -> list[Match | None]:
            part = self.index.get(partition)
            if part is None:
                return [None] * len(texts)
            return best_matches(part, texts, vectors, threshold, k, rule, verifier, now)

        return await asyncio.to_thread(decide)

    async def verified_lookup(
        self,
        partition: PartitionKey,
        text: str,
        rule: SemanticRule,
        tighten_threshold: float | None = None,
        *,
        vectors: np.ndarray | None = None,
    ) -> tuple[Match, Decision] | None:
        """The nearest candidate of a verified partition and whether to serve or explore it
        (see ``semcache.semantic.verified.lookup``)."""
        if vectors is None:
            vectors = await self.encoder.encode([text])
        threshold = effective_threshold(rule, tighten_threshold)
        verifier = self.verifier if rule.verifier else None
        now = self.clock()
        params = verified_params(rule)
        uniform = self.uniform()

        def decide() -> tuple[Match, Decision] | None:
            part = self.index.get(partition)
            if part is None:
                return None
            return verified_candidate(
                part, text, vectors, threshold, verifier, params, uniform, now
            )

        return await asyncio.to_thread(decide)

    def take_explore(self, partition: PartitionKey, per_minute: int) -> bool:
        """Count one judged explore of the partition, unless its minute's cap is reached."""
        return self._explores.take(partition, per_minute, self.clock())

    async def observe(
        self, partition: PartitionKey, payload_ref: str, observation: Observation
    ) -> bool:
        """Add a judged observation to an entry, durably and for the other gateways
        (False: the entry is gone)."""
        part = self.index.get(partition)
        if part is None:
            return False
        now = self.clock()

        def add() -> SemanticRecord | None:
            record = part.observe(payload_ref, observation)
            if record is not None:
                self._persist([record], now)
            return record

        record = await asyncio.to_thread(add)
        if record is None:
            return False
        self.changes += 1
        if self.feed is not None:
            try:
                await self.feed.publish([record])
            except Exception:
                log.exception("publishing an observation failed")
        return True

    async def insert(
        self,
        partition: PartitionKey,
        texts: Sequence[str],
        payload_refs: Sequence[str],
        ttl_s: float | Sequence[float],
        *,
        rule: SemanticRule,
        vectors: np.ndarray | None = None,
    ) -> None:
        """Add one entry per text (its answer stored by the caller under ``payload_refs``)."""
        if not rule.enabled or not texts:
            return
        if vectors is None:
            vectors = await self.encoder.encode(texts)
        now = self.clock()
        ttls = [float(ttl_s)] * len(texts) if isinstance(ttl_s, int | float) else list(ttl_s)
        expires = [now + ttl for ttl in ttls]
        records = [
            SemanticRecord(
                partition=partition,
                text=text,
                payload_ref=ref,
                expires_at=expiry,
                created_at=now,
                vector=vector_bytes(vector),
            )
            for text, ref, expiry, vector in zip(texts, payload_refs, expires, vectors, strict=True)
        ]
        part = self.index.partition(partition, limits_of(rule))

        def add() -> None:
            part.add(texts, vectors, payload_refs, expires, now=now)
            self._persist(records, now)

        await asyncio.to_thread(add)
        self.changes += 1
        if self.feed is not None:
            try:
                await self.feed.publish(records)
            except Exception:  # the local entry stands; other gateways just miss it
                log.exception("publishing %d semantic entries failed", len(records))

    def _persist(self, records: Sequence[SemanticRecord], now: float) -> None:
        """Write records and forget evicted ones in the store (blocking; a worker thread)."""
        if self.store is None:
            return
        try:
            self.store.put(records, now=now)
            for key, refs in self.index.drain_evicted().items():
                self.store.delete(key, refs)
        except Exception as exc:  # a full disk: the entries serve from memory until a restart
            self._persist_failed(len(records), exc)
            return
        if self._persist_failing:
            self._persist_failing = False
            log.warning("semantic records are written again")

    def _persist_failed(self, lost: int, exc: Exception) -> None:
        """Log the first failure of a run, count every record lost."""
        if not self._persist_failing:
            self._persist_failing = True
            log.warning(
                "semantic records cannot be written (%s: %s): new entries serve from memory "
                "and are dropped at the next start (counted; logged again once writes work)",
                type(exc).__name__,
                exc,
            )
        if self.on_persist_failure is not None:
            self.on_persist_failure(lost)

    async def remove(self, partition: PartitionKey, payload_refs: Sequence[str]) -> int:
        """Delete entries by payload ref (e.g. after an exact-cache purge)."""
        part = self.index.get(partition)
        refs = list(payload_refs)

        def remove() -> int:
            removed = part.remove_refs(refs) if part is not None else 0
            if self.store is not None:
                self.store.delete(partition, refs)
            return removed

        self.changes += 1
        return await asyncio.to_thread(remove)

    async def purge(self, predicate: Callable[[PartitionKey], bool]) -> int:
        """Drop every partition the predicate selects (tenant purge, model retired)."""

        def purge() -> int:
            dropped = self.index.remove_partitions(predicate)
            if self.store is not None:
                self.store.delete_partitions(predicate)
            return dropped

        self.changes += 1
        return await asyncio.to_thread(purge)

    async def add_records(self, records: list[SemanticRecord]) -> None:
        """Add records written elsewhere (the feed's sink); they are kept durably too."""
        ours = [r for r in records if r.partition.matcher == self.matcher_version]
        if not ours:
            return
        now = self.clock()

        def add() -> None:
            self.index.add_records(ours, now=now)
            self._persist(ours, now)

        await asyncio.to_thread(add)
        self.changes += 1

    async def start(self) -> None:
        """Start background maintenance and, with a feed, receiving other gateways' entries."""
        if self.feed is not None:
            await self.feed.subscribe(self.add_records)
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain_loop(), name="semantic-gc")

    async def aclose(self) -> None:
        task, self._maintenance = self._maintenance, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.feed is not None:
            await self.feed.aclose()

    async def snapshot(self, folder: Path | str) -> None:
        await asyncio.to_thread(self.index.snapshot, folder)

    async def load(
        self,
        folder: Path | str,
        records: Sequence[SemanticRecord] = (),
        *,
        rule_for: Callable[[PartitionKey], SemanticRule] | None = None,
    ) -> LoadReport:
        """Restore from a snapshot plus the caller's records (rebuilds when stale)."""
        ours = [r for r in records if r.partition.matcher == self.matcher_version]

        def limits_for(key: PartitionKey) -> Limits:
            return limits_of(rule_for(key)) if rule_for is not None else Limits()

        if self.store is None:
            return await asyncio.to_thread(
                self.index.load, folder, ours, limits_for=limits_for, now=self.clock()
            )
        now, matcher = self.clock(), self.matcher_version
        return await asyncio.to_thread(
            reconcile, self.index, self.store, Path(folder), limits_for, now, matcher
        )

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.maintenance_interval_s)
            try:
                await asyncio.to_thread(self.index.maintain, self.clock())
            except Exception:
                log.exception("semantic index maintenance failed")
