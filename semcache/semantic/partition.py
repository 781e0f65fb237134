"""The FAISS index of one hard partition (tenant, model, template): its entries and vectors.

A partition starts as an exact ``IndexFlatIP`` and switches to HNSW once it holds more
than ``ann_after`` entries. Removal (expiry, eviction, delete) hides the id at once (the
search skips it through an ``IDSelector``); flat indexes then drop the vectors for real
(``remove_ids``), HNSW cannot, so its hidden ids are tombstones that a rebuild clears once
they pass a fraction of the index. Memory thus stays bounded by ``max_entries``.

All methods are blocking (FAISS, numpy); async callers run them in a worker thread.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import faiss as _faiss
import msgspec
import numpy as np

from semcache.semantic.records import IndexEntry, PartitionKey, SemanticRecord, vector_bytes
from semcache.semantic.verified import (
    Decision,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
)

# FAISS's SWIG classes are typed loosely (and differ between CPU and GPU builds).
faiss: Any = _faiss

IndexKind = Literal["flat", "hnsw"]


class IndexSettings(msgspec.Struct, kw_only=True, frozen=True):
    """How partitions are built; the per-rule limits come with each call."""

    dimensions: int = 384
    hnsw_m: int = 48
    """Graph degree. 48 rather than faiss's usual 32: near-duplicate-heavy partitions reach
    the recall target at a smaller efSearch, for more memory per vector
    (``bench/semantic_lookup.py``; figures in bench/RESULTS.md)."""
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 128
    """efSearch of partitions up to ``hnsw_ef_base_entries`` entries."""
    hnsw_ef_base_entries: int = 100_000
    hnsw_ef_growth: float = 1.08
    """Past the base size, efSearch grows as ``(entries / base) ** growth``: a bigger graph
    needs a wider beam for the same recall (``bench/semantic_lookup.py``)."""
    hnsw_ef_max: int = 2048
    tombstone_fraction: float = 0.2
    """An HNSW partition is rebuilt once this share of its vectors are dead."""
    background: bool = True
    """Build HNSW / compact in a background thread (False: inline, for tests and benches)."""
    use_gpu: bool | None = None
    """Mirror flat partitions on the GPU; None: when ``faiss.get_num_gpus() > 0``."""
    search_threads: int = 1
    """FAISS OpenMP threads; lookups are single queries, where more threads only add overhead."""


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    """Per-partition limits taken from the policy rule (``SemanticRule``)."""

    ann_after: int = 50_000
    max_entries: int = 1_000_000


class Hit(msgspec.Struct, frozen=True):
    entry: IndexEntry
    similarity: float


class PartitionStats(msgspec.Struct, kw_only=True):
    key: PartitionKey
    kind: IndexKind
    entries: int
    vectors: int
    """Vectors physically in the FAISS index (entries plus not yet dropped dead ones)."""
    hidden: int
    on_gpu: bool


def configure_faiss_threads(threads: int) -> None:
    faiss.omp_set_num_threads(max(1, threads))


def _gpu_resources() -> Any:
    return faiss.StandardGpuResources()


class PartitionState(msgspec.Struct, kw_only=True):
    """What a partition holds besides its FAISS index (what a snapshot keeps next to it)."""

    key: PartitionKey
    kind: IndexKind
    next_id: int
    hidden: list[int]
    """Ids still in the FAISS index whose entries are gone."""
    entries: list[IndexEntry]


class PartitionIndex:
    """The FAISS index and the entries of one partition (thread-safe)."""

    def __init__(self, key: PartitionKey, settings: IndexSettings, limits: Limits) -> None:
        self.key = key
        self.settings = settings
        self.limits = limits
        self.kind: IndexKind = "flat"
        self._lock = threading.RLock()
        self._index: Any = self._new_index("flat")
        self._entries: OrderedDict[int, IndexEntry] = OrderedDict()  # oldest first
        self._by_ref: dict[str, int] = {}
        self._expiry: list[tuple[float, int]] = []
        self._hidden: set[int] = set()
        self._evicted: list[str] = []
        """Payload refs evicted by ``max_entries`` since the last ``drain_evicted``."""
        self._selector: Any = None
        self._selector_batch: Any = None
        self._next_id = 1
        self._rebuilding = False
        self._rebuild_thread: threading.Thread | None = None
        self._gpu_res: Any = None
        self._gpu_index: Any = None
        self.prior = PartitionPrior()
        """Every entry's observations (verified partitions); kept in step with the entries."""
        want_gpu = settings.use_gpu
        self._use_gpu = bool(faiss.get_num_gpus() > 0 if want_gpu is None else want_gpu)

    # -- public -----------------------------------------------------------------------

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
                vectors=int(self._index.ntotal),
                hidden=len(self._hidden),
                on_gpu=self._gpu_index is not None,
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
                self._index.add_with_ids(block, ids_array)
                if self._gpu_index is not None:
                    self._gpu_index.add_with_ids(block, ids_array)
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
            index, params = self._search_target(ef_search)
            if params is None:
                scores, labels = index.search(queries, k)
            else:
                scores, labels = index.search(queries, k, params=params)
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
            return np.asarray(
                self._index.reconstruct_batch(np.asarray(ids, dtype=np.int64)), dtype=np.float32
            )

    def decide(
        self, payload_ref: str, similarity: float, params: VerifiedParams, uniform: float
    ) -> Decision | None:
        """Serve or explore the entry of ``payload_ref`` (None: it is gone)."""
        with self._lock:
            entry_id = self._by_ref.get(payload_ref)
            if entry_id is None:
                return None
            entry = self._entries[entry_id]
            return decide(similarity, entry.observations, self.prior, params, uniform)

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
        thread = self._rebuild_thread
        if thread is not None:
            thread.join(timeout)

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
        self._hidden.add(entry_id)
        self._selector = None

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
        if self._rebuilding:
            return
        if self.kind == "flat":
            if self._hidden:
                self._index.remove_ids(np.fromiter(self._hidden, dtype=np.int64))
                self._hidden.clear()
                self._selector = None
                self._gpu_index = None  # GPU flat indexes cannot remove: re-mirror lazily
            if len(self._entries) > self.limits.ann_after:
                self._start_rebuild("hnsw")
        else:
            total = int(self._index.ntotal)
            if total and len(self._hidden) > self.settings.tombstone_fraction * total:
                self._start_rebuild("hnsw")

    # -- search plumbing ----------------------------------------------------------------

    def _search_target(self, ef_search: int | None = None) -> tuple[Any, Any]:
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = ef_search or self.ef_search()
            if self._hidden:
                params.sel = self._hidden_selector()
            return self._index, params
        if self._hidden:
            params = faiss.SearchParameters()
            params.sel = self._hidden_selector()
            return self._index, params
        if self._use_gpu:
            return self._gpu_mirror(), None
        return self._index, None

    def _hidden_selector(self) -> Any:
        if self._selector is None:
            batch = faiss.IDSelectorBatch(np.fromiter(self._hidden, dtype=np.int64))
            selector = faiss.IDSelectorNot(batch)
            self._selector = selector
            self._selector_batch = batch  # the SWIG object must outlive the selector
        return self._selector

    def _gpu_mirror(self) -> Any:
        if self._gpu_index is None:
            if self._gpu_res is None:
                self._gpu_res = _gpu_resources()
            gpu_flat = faiss.index_cpu_to_gpu(self._gpu_res, 0, faiss.IndexFlatIP(self.dim))
            mirror = faiss.IndexIDMap2(gpu_flat)  # faiss keeps a reference to gpu_flat
            ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
            if len(ids):
                mirror.add_with_ids(self._index.index.reconstruct_n(0, len(ids)), ids)
            self._gpu_index = mirror
        return self._gpu_index

    @property
    def dim(self) -> int:
        return self.settings.dimensions

    def _new_index(self, kind: IndexKind) -> Any:
        if kind == "flat":
            inner: Any = faiss.IndexFlatIP(self.dim)
        else:
            inner = faiss.IndexHNSWFlat(self.dim, self.settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = self.settings.hnsw_ef_construction
            inner.hnsw.efSearch = self.settings.hnsw_ef_search
        return faiss.IndexIDMap2(inner)  # faiss keeps a reference to inner

    # -- rebuild (flat -> HNSW, or HNSW compaction) ---------------------------------------

    def _start_rebuild(self, kind: IndexKind) -> None:
        self._rebuilding = True
        source_ids = np.asarray(list(self._entries), dtype=np.int64)
        source = self._index
        if self.settings.background:
            thread = threading.Thread(
                target=self._rebuild, args=(kind, source, source_ids), daemon=True
            )
            self._rebuild_thread = thread
            thread.start()
        else:
            self._rebuild(kind, source, source_ids)

    def _rebuild(self, kind: IndexKind, source: Any, source_ids: np.ndarray) -> None:
        try:
            with self._lock:
                vectors = source.reconstruct_batch(source_ids) if len(source_ids) else None
            fresh = self._new_index(kind)
            if vectors is not None:
                fresh.add_with_ids(vectors, source_ids)  # the slow part, outside the lock
            with self._lock:
                built = set(source_ids.tolist())
                # Entries added while building: copy their vectors from the old index.
                late = [entry_id for entry_id in self._entries if entry_id not in built]
                if late:
                    late_ids = np.asarray(late, dtype=np.int64)
                    fresh.add_with_ids(self._index.reconstruct_batch(late_ids), late_ids)
                self._hidden = {entry_id for entry_id in built if entry_id not in self._entries}
                self._selector = None
                self._index = fresh
                self.kind = kind
                self._gpu_index = None
        finally:
            with self._lock:
                self._rebuilding = False

    # -- export and restore (snapshots) ---------------------------------------------------

    def export(self, save: Callable[[Any, PartitionState], None]) -> None:
        """Hand the FAISS index and the state that matches it to ``save``, under the lock."""
        with self._lock:
            state = PartitionState(
                key=self.key,
                kind=self.kind,
                next_id=self._next_id,
                hidden=sorted(self._hidden),
                entries=list(self._entries.values()),
            )
            save(self._index, state)

    @classmethod
    def restore(
        cls, index: Any, state: PartitionState, settings: IndexSettings, limits: Limits, now: float
    ) -> PartitionIndex:
        """The partition ``export`` handed out (``index`` must be id-mapped and match
        ``state``); entries expired by ``now`` are dropped."""
        part = cls(state.key, settings, limits)
        part._index = index
        part.kind = state.kind
        part._next_id = state.next_id
        part._hidden = set(state.hidden)
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


def as_matrix(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    if matrix.ndim == 1:
        matrix = matrix.reshape(1, -1)
    if matrix.shape[1] != dimensions:
        raise ValueError(f"vectors have {matrix.shape[1]} dimensions, the index {dimensions}")
    return matrix
