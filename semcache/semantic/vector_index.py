"""One partition's FAISS vectors by entry id: exact flat search first, HNSW past a size.

A partition's vectors start in an exact ``IndexFlatIP`` and move to HNSW once the partition
holds more than ``ann_after`` entries. A removed id is hidden at once (the search skips it
through an ``IDSelector``); a flat index then drops the vectors for real (``remove_ids``),
HNSW cannot, so its hidden ids are tombstones that a rebuild clears once they pass a
fraction of the index. Flat indexes are mirrored on the GPU when there is one.

All methods are blocking (FAISS, numpy).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import faiss as _faiss
import numpy as np

from semcache.semantic.partition_types import IndexKind, IndexSettings

# FAISS's SWIG classes are typed loosely (and differ between CPU and GPU builds).
faiss: Any = _faiss


def configure_faiss_threads(threads: int) -> None:
    faiss.omp_set_num_threads(max(1, threads))


def _gpu_resources() -> Any:
    return faiss.StandardGpuResources()


def as_matrix(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    if matrix.ndim == 1:
        matrix = matrix.reshape(1, -1)
    if matrix.shape[1] != dimensions:
        raise ValueError(f"vectors have {matrix.shape[1]} dimensions, the index {dimensions}")
    return matrix


class VectorIndex:
    """The id-mapped FAISS index of one partition, its hidden ids and its GPU mirror.

    ``live`` is the partition's entries by id, oldest first: a rebuild keeps their vectors
    and hides the rest. ``lock`` is the partition's lock: callers hold it, a background
    rebuild takes it.
    """

    def __init__(
        self, settings: IndexSettings, lock: threading.RLock, live: Mapping[int, object]
    ) -> None:
        self.settings = settings
        self.kind: IndexKind = "flat"
        self._lock = lock
        self._live = live
        self.index: Any = self._new_index("flat")
        self.hidden: set[int] = set()
        """Ids still in the FAISS index whose entries are gone."""
        self._selector: Any = None
        self._selector_batch: Any = None
        self._rebuilding = False
        self._rebuild_thread: threading.Thread | None = None
        self._gpu_res: Any = None
        self._gpu_index: Any = None
        want_gpu = settings.use_gpu
        self._use_gpu = bool(faiss.get_num_gpus() > 0 if want_gpu is None else want_gpu)

    @property
    def dim(self) -> int:
        return self.settings.dimensions

    @property
    def ntotal(self) -> int:
        """Vectors physically in the FAISS index (live plus not yet dropped hidden ones)."""
        return int(self.index.ntotal)

    @property
    def on_gpu(self) -> bool:
        return self._gpu_index is not None

    def add(self, block: np.ndarray, ids: np.ndarray) -> None:
        self.index.add_with_ids(block, ids)
        if self._gpu_index is not None:
            self._gpu_index.add_with_ids(block, ids)

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.index.reconstruct_batch(ids), dtype=np.float32)

    def hide(self, entry_id: int) -> None:
        """Skip an id in every search from now on (its vector is dropped later)."""
        self.hidden.add(entry_id)
        self._selector = None

    def search(self, queries: np.ndarray, k: int, ef_search: int) -> tuple[Any, Any]:
        """Scores and ids of the k nearest vectors not hidden (``ef_search``: HNSW beam)."""
        index, params = self._search_target(ef_search)
        if params is None:
            return index.search(queries, k)
        return index.search(queries, k, params=params)

    def maintain(self, ann_due: bool) -> None:
        """Drop hidden vectors of a flat index, switch to HNSW when ``ann_due``, or compact
        an HNSW index past its tombstone fraction (unless a rebuild is running)."""
        if self._rebuilding:
            return
        if self.kind == "flat":
            if self.hidden:
                self.index.remove_ids(np.fromiter(self.hidden, dtype=np.int64))
                self.hidden.clear()
                self._selector = None
                self._gpu_index = None  # GPU flat indexes cannot remove: re-mirror lazily
            if ann_due:
                self._start_rebuild("hnsw")
        else:
            total = int(self.index.ntotal)
            if total and len(self.hidden) > self.settings.tombstone_fraction * total:
                self._start_rebuild("hnsw")

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for a background rebuild to finish (tests, shutdown, snapshots)."""
        thread = self._rebuild_thread
        if thread is not None:
            thread.join(timeout)

    def restore(self, index: Any, kind: IndexKind, hidden: list[int]) -> None:
        """Take over a FAISS index a snapshot kept (id-mapped) and its hidden ids."""
        self.index = index
        self.kind = kind
        self.hidden = set(hidden)

    # -- search plumbing ----------------------------------------------------------------

    def _search_target(self, ef_search: int) -> tuple[Any, Any]:
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = ef_search
            if self.hidden:
                params.sel = self._hidden_selector()
            return self.index, params
        if self.hidden:
            params = faiss.SearchParameters()
            params.sel = self._hidden_selector()
            return self.index, params
        if self._use_gpu:
            return self._gpu_mirror(), None
        return self.index, None

    def _hidden_selector(self) -> Any:
        if self._selector is None:
            batch = faiss.IDSelectorBatch(np.fromiter(self.hidden, dtype=np.int64))
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
            ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
            if len(ids):
                mirror.add_with_ids(self.index.index.reconstruct_n(0, len(ids)), ids)
            self._gpu_index = mirror
        return self._gpu_index

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
        source_ids = np.asarray(list(self._live), dtype=np.int64)
        source = self.index
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
                late = [entry_id for entry_id in self._live if entry_id not in built]
                if late:
                    late_ids = np.asarray(late, dtype=np.int64)
                    fresh.add_with_ids(self.index.reconstruct_batch(late_ids), late_ids)
                self.hidden = {entry_id for entry_id in built if entry_id not in self._live}
                self._selector = None
                self.index = fresh
                self.kind = kind
                self._gpu_index = None
        finally:
            with self._lock:
                self._rebuilding = False
