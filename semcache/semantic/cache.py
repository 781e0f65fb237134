"""The semantic cache: encode, search one partition, optionally verify, per input item.

The cache stores no answers: an entry points (``payload_ref``) to the answer the caller
keeps in the exact tiers. A lookup returns, for each input text, the best cached entry
that passes the rule's threshold (and the verifier, when the rule asks for it), or None.

Threshold rule: the effective threshold is ``max(rule.threshold, requested)``. A request
may tighten (raise) the policy's threshold, never loosen it; ``rule.min_threshold`` is the
policy loader's lower bound on ``rule.threshold`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from semcache.semantic.encoder import Encoder
from semcache.semantic.feed import EntryFeed
from semcache.semantic.index import LoadReport, SemanticIndex
from semcache.semantic.partition import Hit, Limits, PartitionIndex
from semcache.semantic.records import PartitionKey, SemanticRecord, vector_bytes
from semcache.semantic.settings import SemanticRule
from semcache.semantic.store import RecordStore
from semcache.semantic.verified import Decision, Observation, VerifiedParams
from semcache.semantic.verifier import PairVerifier

log = logging.getLogger(__name__)

# Cosine of a text with itself is 1 up to float rounding; thresholds compare with this slack.
_SLACK = 1e-5


class Match(msgspec.Struct, frozen=True, kw_only=True):
    """A cached entry that may answer the input text."""

    payload_ref: str
    similarity: float
    verifier_prob: float | None
    """The verifier's probability that both texts mean the same (None: not asked)."""
    text: str
    """The cached text whose answer is served."""


def effective_threshold(rule: SemanticRule, requested: float | None = None) -> float:
    """The policy threshold, raised (never lowered) by a request's own value."""
    threshold = rule.threshold if requested is None else max(rule.threshold, requested)
    return min(threshold, 1.0)


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
        self._explores: dict[PartitionKey, tuple[int, int]] = {}
        """Judged explores per partition in the current minute: (minute, count)."""
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
        return await asyncio.to_thread(
            self._decide, partition, texts, vectors, threshold, k, rule, use_verifier, now
        )

    def _decide(
        self,
        partition: PartitionKey,
        texts: Sequence[str],
        vectors: np.ndarray,
        threshold: float,
        k: int,
        rule: SemanticRule,
        use_verifier: bool,
        now: float,
    ) -> list[Match | None]:
        part = self.index.get(partition)
        if part is None:
            return [None] * len(texts)
        hits = part.search(vectors, k, now=now)
        passing = [[h for h in row if h.similarity >= threshold - _SLACK] for row in hits]
        if not use_verifier:
            return [_match(row[0], None) if row else None for row in passing]
        assert self.verifier is not None
        # One batched verifier call for every (query, candidate) pair of the request.
        owners: list[int] = []
        candidates: list[Hit] = []
        for row_index, row in enumerate(passing):
            owners.extend([row_index] * len(row))
            candidates.extend(row)
        results: list[Match | None] = [None] * len(texts)
        if not candidates:
            return results
        candidate_vectors = part.vectors_of([hit.entry.id for hit in candidates])
        probs = self.verifier.probabilities(
            vectors[owners],
            candidate_vectors,
            [texts[i] for i in owners],
            [hit.entry.text for hit in candidates],
        )
        best: dict[int, tuple[float, Hit]] = {}
        for owner, hit, prob in zip(owners, candidates, probs.tolist(), strict=True):
            if prob >= rule.verifier_min_prob and (owner not in best or prob > best[owner][0]):
                best[owner] = (prob, hit)
        for owner, (prob, hit) in best.items():
            results[owner] = _match(hit, prob)
        return results

    async def verified_lookup(
        self,
        partition: PartitionKey,
        text: str,
        rule: SemanticRule,
        tighten_threshold: float | None = None,
        *,
        vectors: np.ndarray | None = None,
    ) -> tuple[Match, Decision] | None:
        """The nearest candidate of a verified partition and whether to serve or explore it.

        Candidates are the nearest entries at or above the threshold (which is a floor here);
        with the verifier on, the score the entry's curve is learned over is the verifier's
        probability instead of the cosine.
        """
        if vectors is None:
            vectors = await self.encoder.encode([text])
        threshold = effective_threshold(rule, tighten_threshold)
        use_verifier = rule.verifier and self.verifier is not None
        now = self.clock()
        params = VerifiedParams(
            max_error=rule.max_error,
            min_observations=rule.min_observations,
            prior_weight=rule.prior_weight,
            prior_bandwidth=rule.prior_bandwidth,
            audit_rate=rule.audit_rate,
        )
        uniform = self.uniform()

        def decide() -> tuple[Match, Decision] | None:
            part = self.index.get(partition)
            if part is None:
                return None
            (row,) = part.search(vectors, 1, now=now)
            if not row or row[0].similarity < threshold - _SLACK:
                return None
            hit = row[0]
            prob: float | None = None
            if use_verifier:
                assert self.verifier is not None
                prob = float(
                    self.verifier.probabilities(
                        vectors, part.vectors_of([hit.entry.id]), [text], [hit.entry.text]
                    )[0]
                )
            score = prob if prob is not None else hit.similarity
            decision = part.decide(hit.entry.payload_ref, score, params, uniform)
            return (_match(hit, prob), decision) if decision is not None else None

        return await asyncio.to_thread(decide)

    def take_explore(self, partition: PartitionKey, per_minute: int) -> bool:
        """Count one judged explore of the partition, unless its minute's cap is reached."""
        minute = int(self.clock() // 60)
        start, count = self._explores.get(partition, (minute, 0))
        if start != minute:
            count = 0
        if count >= per_minute:
            return False
        self._explores[partition] = (minute, count + 1)
        if len(self._explores) > 10_000:  # forget partitions idle since an earlier minute
            self._explores = {k: v for k, v in self._explores.items() if v[0] == minute}
        return True

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
        return await asyncio.to_thread(self._restore, Path(folder), limits_for, self.clock())

    def _restore(
        self, folder: Path, limits_for: Callable[[PartitionKey], Limits], now: float
    ) -> LoadReport:
        """The snapshot reconciled with the durable records (blocking).

        The records are the truth: a snapshot entry without a record (evicted, purged or
        removed after the snapshot was written) is dropped, a record the snapshot lacks
        (written after it, or no usable snapshot at all) is added, oldest first, so
        ``max_entries`` evicts the same entries it would have. Partitions and records of
        another matcher version (a retrained verifier) are dropped for good.
        """
        assert self.store is not None
        report = self.index.load(folder, (), limits_for=limits_for, now=now)
        matcher = self.matcher_version
        self.store.delete_partitions(lambda key: key.matcher != matcher)
        self.index.remove_partitions(lambda key: key.matcher != matcher)
        durable = self.store.refs()
        by_digest = {key.digest(): key for key in self.index.keys()}
        for digest, key in by_digest.items():
            part = self.index.get(key)
            if part is None:
                continue
            keep = durable.get(digest, set())
            doomed = [ref for ref in part.payload_refs() if ref not in keep]
            if doomed:
                report.dropped += part.remove_refs(doomed, now=now)
        missing: list[tuple[str, str]] = []
        for digest, stored in durable.items():
            known = by_digest.get(digest)
            found = self.index.get(known) if known is not None else None
            missing.extend(
                (digest, ref) for ref in stored if found is None or not found.has_ref(ref)
            )
        # Observations judged after the snapshot was written: merged into its entries.
        observed = [
            (digest, ref)
            for digest, ref in self.store.observed()
            if (holder := self._holder(by_digest.get(digest))) is not None and holder.has_ref(ref)
        ]
        if observed:
            self.index.add_records(self.store.get_many(observed), now=now)
        records = [r for r in self.store.get_many(missing) if r.partition.matcher == matcher]
        records.sort(key=lambda r: r.created_at)
        rebuilt = {r.partition for r in records} - set(by_digest.values())
        for key in {r.partition for r in records}:
            self.index.partition(key, limits_for(key))
        report.records_added = self.index.add_records(
            records, now=now, progress="semantic cache: restoring"
        )
        report.rebuilt = len(rebuilt)
        for key, evicted in self.index.drain_evicted().items():
            self.store.delete(key, evicted)
        self.index.remove_partitions(lambda key: (p := self.index.get(key)) is None or not len(p))
        return report

    def _holder(self, key: PartitionKey | None) -> PartitionIndex | None:
        return self.index.get(key) if key is not None else None

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.maintenance_interval_s)
            try:
                await asyncio.to_thread(self.index.maintain, self.clock())
            except Exception:
                log.exception("semantic index maintenance failed")


def _match(hit: Hit, prob: float | None) -> Match:
    return Match(
        payload_ref=hit.entry.payload_ref,
        similarity=hit.similarity,
        verifier_prob=prob,
        text=hit.entry.text,
    )
