"""One hard partition (tenant, model, template): its entries, their expiry and eviction, and
the judged observations of a verified partition; the vectors live in a ``VectorIndex``.

Removal (expiry, eviction, delete) hides the entry's id in the vector index at once; the
vector index drops or compacts the dead vectors later (``semcache.semantic.vector_index``).
Memory thus stays bounded by ``max_entries``.

All methods are blocking (FAISS, numpy); async callers run them in a worker thread.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from semcache.semantic.partition_types import (
    Hit,
    IndexKind,
    IndexSettings,
    Limits,
    PartitionState,
    PartitionStats,
)
from semcache.semantic.records import IndexEntry, PartitionKey, SemanticRecord, vector_bytes
from semcache.semantic.vector_index import VectorIndex, as_matrix
from semcache.semantic.verified.decisions import (
    Decision,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
    pooled_prior,
)


class PartitionIndex:
    """The entries of one partition and their vector index (thread-safe)."""

    def __init__(self, key: PartitionKey, settings: IndexSettings, limits: Limits) -> None:
        self.key = key
        self.settings = settings
        self.limits = limits
        self._lock = threading.RLock()
        self._entries: OrderedDict[int, IndexEntry] = OrderedDict()  # oldest first
        self._vectors = VectorIndex(settings, self._lock, self._entries)
        self._by_ref: dict[str, int] = {}
        self._expiry: list[tuple[float, int]] = []
        self._evicted: list[str] = []
        """Payload refs evicted by ``max_entries`` since the last ``drain_evicted``."""
        self._next_id = 1
        self.prior = PartitionPrior()
        """Every entry's observations (verified partitions); kept in step with the entries."""

    # -- public -----------------------------------------------------------------------

    @property
    def kind(self) -> IndexKind:
        """``flat`` (exact search) until the switch to ``hnsw``."""
        return self._vectors.kind

    @property
    def dim(self) -> int:
        return self.settings.dimensions

    def __len__(self) -> int:
        return len(self._entries)

    def has_ref(self, payload_ref: str) -> bool:
        return payload_ref in self._by_ref

    def payload_refs(self) -> list[str]:
        with self._lock:
            return list(self._by_ref)

    def drain_evicted(self) -> list[str]:
        """Payload refs evicted (``max_entries``) since the last call, for the record store."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
            return evicted

    def stats(self) -> PartitionStats:
        with self._lock:
            return PartitionStats(
                key=self.key,
                kind=self.kind,
                entries=len(self._entries),
                vectors=self._vectors.ntotal,
                hidden=len(self._vectors.hidden),
                on_gpu=self._vectors.on_gpu,
            )

    def add(
        self,
        texts: Sequence[str],
        vectors: np.ndarray,
        payload_refs: Sequence[str],
        expires_at: Sequence[float],
        *,
        created_at: Sequence[float] | None = None,
        observations: Sequence[Sequence[Observation]] | None = None,
        now: float | None = None,
    ) -> list[int]:
        """Add entries; an existing ``payload_ref`` only has its expiry extended and the
        given observations merged into its own.

        Returns the entry id of each item. Expired items are skipped (id 0).
        """
        now = time.time() if now is None else now
        vectors = as_matrix(vectors, self.settings.dimensions)
        if not len(texts) == len(vectors) == len(payload_refs) == len(expires_at):
            raise ValueError("texts, vectors, payload_refs and expires_at differ in length")
        with self._lock:
            ids: list[int] = []
            new_rows: list[int] = []
            new_ids: list[int] = []
            for row, (text, ref, expiry) in enumerate(
                zip(texts, payload_refs, expires_at, strict=True)
            ):
                if expiry <= now:
                    ids.append(0)
                    continue
                existing = self._by_ref.get(ref)
                seen = observations[row] if observations is not None else ()
                if existing is not None:
                    entry = self._entries[existing]
                    if expiry > entry.expires_at:
                        entry.expires_at = expiry
                        heapq.heappush(self._expiry, (expiry, existing))
                    for obs in seen:
                        self._observe_locked(entry, obs)
                    ids.append(existing)
                    continue
                entry_id = self._next_id
                self._next_id += 1
                born = created_at[row] if created_at is not None else now
                entry = IndexEntry(
                    id=entry_id, text=text, payload_ref=ref, expires_at=expiry, created_at=born
                )
                for obs in seen:
                    self._observe_locked(entry, obs)
                self._entries[entry_id] = entry
                self._by_ref[ref] = entry_id
                heapq.heappush(self._expiry, (expiry, entry_id))
                ids.append(entry_id)
                new_rows.append(row)
                new_ids.append(entry_id)
            if new_ids:
                ids_array = np.asarray(new_ids, dtype=np.int64)
                block = np.ascontiguousarray(vectors[new_rows])
                self._vectors.add(block, ids_array)
            self._evict_oldest()
            self._maintain_locked(now)
            return ids

    def ef_search(self) -> int:
        """The HNSW beam width for this partition's size (see ``IndexSettings``)."""
        s = self.settings
        grown = s.hnsw_ef_search * max(1.0, len(self._entries) / s.hnsw_ef_base_entries) ** (
            s.hnsw_ef_growth
        )
        return min(max(s.hnsw_ef_search, s.hnsw_ef_max), math.ceil(grown))

    def search(
        self,
        vectors: np.ndarray,
        k: int,
        *,
        now: float | None = None,
        ef_search: int | None = None,
    ) -> list[list[Hit]]:
        """The k nearest live entries of each query vector (inner product = cosine).

        ``ef_search`` overrides the HNSW beam width chosen by size (benchmarks).
        """
        now = time.time() if now is None else now
        queries = as_matrix(vectors, self.settings.dimensions)
        with self._lock:
            self._hide_expired(now)
            if not self._entries or len(queries) == 0:
                return [[] for _ in range(len(queries))]
            k = min(k, len(self._entries))
            scores, labels = self._vectors.search(queries, k, ef_search or self.ef_search())
            results: list[list[Hit]] = []
            for row_scores, row_labels in zip(scores, labels, strict=True):
                hits: list[Hit] = []
                for score, label in zip(row_scores, row_labels, strict=True):
                    entry = self._entries.get(int(label))
                    if entry is not None and entry.expires_at > now:
                        hits.append(Hit(entry, float(score)))
                results.append(hits)
            return results

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """Stored vectors of entries (for the verifier); ids must be live."""
        with self._lock:
            if not ids:
                return np.zeros((0, self.settings.dimensions), dtype=np.float32)
            return self._vectors.reconstruct(np.asarray(ids, dtype=np.int64))

    def decide(
        self,
        payload_ref: str,
        similarity: float,
        params: VerifiedParams,
        uniform: float,
        *,
        now: float | None = None,
    ) -> Decision | None:
        """Serve or explore the entry of ``payload_ref`` (None: it is gone), on the prior
        of its ``params.prior_neighbours`` nearest entries."""
        with self._lock:
            entry_id = self._by_ref.get(payload_ref)
            if entry_id is None:
                return None
            entry = self._entries[entry_id]
            prior = self.prior
            k = params.prior_neighbours
            if 0 < k < len(self._entries):  # a smaller partition is its own neighbourhood
                (row,) = self.search(self.vectors_of([entry_id]), k, now=now)
                near = {hit.entry.id: hit.entry for hit in row} | {entry_id: entry}
                prior = pooled_prior(e.observations for e in near.values())
            return decide(similarity, entry.observations, prior, params, uniform)

    def observe(self, payload_ref: str, observation: Observation) -> SemanticRecord | None:
        """Add a judged observation to an entry; its record as it now is (None: gone)."""
        with self._lock:
            entry_id = self._by_ref.get(payload_ref)
            if entry_id is None:
                return None
            entry = self._entries[entry_id]
            self._observe_locked(entry, observation)
            vector = self.vectors_of([entry_id])[0]
            return _record(self.key, entry, vector)

    def observations_of(self, payload_ref: str) -> list[Observation]:
        with self._lock:
            entry_id = self._by_ref.get(payload_ref)
            return list(self._entries[entry_id].observations) if entry_id is not None else []

    def _observe_locked(self, entry: IndexEntry, observation: Observation) -> None:
        if observation in entry.observations:
            return  # already known (a feed's copy)
        kept, dropped = observed(entry.observations, observation)
        entry.observations = kept
        self.prior.add([observation])
        self.prior.remove(dropped)

    def remove_refs(self, payload_refs: Iterable[str], *, now: float | None = None) -> int:
        """Delete the entries of these payload refs (e.g. a purge); returns how many."""
        with self._lock:
            removed = 0
            for ref in payload_refs:
                entry_id = self._by_ref.get(ref)
                if entry_id is not None:
                    self._remove_entry(entry_id)
                    removed += 1
            self._maintain_locked(time.time() if now is None else now)
            return removed

    def remove_where(self, predicate: Callable[[IndexEntry], bool]) -> int:
        with self._lock:
            doomed = [entry.payload_ref for entry in self._entries.values() if predicate(entry)]
        return self.remove_refs(doomed)

    def maintain(self, now: float | None = None) -> None:
        """Drop expired entries, free dead vectors, start a rebuild or ANN switch if due."""
        with self._lock:
            self._maintain_locked(time.time() if now is None else now)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for a background rebuild to finish (tests, shutdown, snapshots)."""
        self._vectors.wait_idle(timeout)

    def records(self) -> list[SemanticRecord]:
        """Every live entry with its vector (to feed another index or a store)."""
        with self._lock:
            entries = list(self._entries.values())
            vectors = self.vectors_of([entry.id for entry in entries])
        return [
            _record(self.key, entry, vector) for entry, vector in zip(entries, vectors, strict=True)
        ]

    # -- removal, expiry, eviction ------------------------------------------------------

    def _remove_entry(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        self.prior.remove(entry.observations)
        if self._by_ref.get(entry.payload_ref) == entry_id:
            del self._by_ref[entry.payload_ref]
        self._vectors.hide(entry_id)

    def _hide_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, entry_id = heapq.heappop(self._expiry)
            entry = self._entries.get(entry_id)
            # A stale heap item (its entry was refreshed or removed) is just dropped.
            if entry is not None and entry.expires_at <= now:
                self._remove_entry(entry_id)

    def _evict_oldest(self) -> None:
        excess = len(self._entries) - self.limits.max_entries
        for _ in range(max(0, excess)):
            entry_id = next(iter(self._entries))
            self._evicted.append(self._entries[entry_id].payload_ref)
            self._remove_entry(entry_id)

    def _maintain_locked(self, now: float) -> None:
        self._hide_expired(now)
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            self._expiry = [(e.expires_at, e.id) for e in self._entries.values()]
            heapq.heapify(self._expiry)
        self._vectors.maintain(len(self._entries) > self.limits.ann_after)

    # -- export and restore (snapshots) ---------------------------------------------------

    def export(self, save: Callable[[Any, PartitionState], None]) -> None:
        """Hand the FAISS index and the state that matches it to ``save``, under the lock."""
        with self._lock:
            state = PartitionState(
                key=self.key,
                kind=self.kind,
                next_id=self._next_id,
                hidden=sorted(self._vectors.hidden),
                entries=list(self._entries.values()),
            )
            save(self._vectors.index, state)

    @classmethod
    def restore(
        cls, index: Any, state: PartitionState, settings: IndexSettings, limits: Limits, now: float
    ) -> PartitionIndex:
        """The partition ``export`` handed out (``index`` must be id-mapped and match
        ``state``); entries expired by ``now`` are dropped."""
        part = cls(state.key, settings, limits)
        part._vectors.restore(index, state.kind, state.hidden)
        part._next_id = state.next_id
        for entry in state.entries:
            part._entries[entry.id] = entry
            part._by_ref[entry.payload_ref] = entry.id
            part._expiry.append((entry.expires_at, entry.id))
            part.prior.add(entry.observations)
        heapq.heapify(part._expiry)
        with part._lock:
            part._maintain_locked(now)
        return part


def _record(key: PartitionKey, entry: IndexEntry, vector: np.ndarray) -> SemanticRecord:
    return SemanticRecord(
        partition=key,
        text=entry.text,
        payload_ref=entry.payload_ref,
        expires_at=entry.expires_at,
        created_at=entry.created_at,
        vector=vector_bytes(vector),
        observations=list(entry.observations),
    )
