"""The semantic index of one gateway: one FAISS partition per hard partition.

A lookup names its partition and searches that partition's index only, so an entry of
another tenant, model or template can never come back (there is no shared index searched
first and filtered after). Partitions are created on their first insert
(``semcache.semantic.partition``) and persisted as snapshots (``semcache.semantic.snapshot``).

All methods are blocking (FAISS, numpy); async callers run them in a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import Hit, IndexSettings, Limits
from semcache.semantic.records import PartitionKey, SemanticRecord
from semcache.semantic.snapshot import read_snapshot, write_snapshot
from semcache.semantic.vector_index import as_matrix, configure_faiss_threads


class LoadReport(msgspec.Struct, kw_only=True):
    loaded: int = 0
    """Partitions read from the snapshot."""
    rebuilt: int = 0
    """Partitions built from the supplied records (snapshot missing or stale)."""
    records_added: int = 0
    dropped: int = 0
    """Snapshot entries dropped because their durable record is gone (evicted, purged)."""
    stale_reason: str | None = None


class SemanticIndex:
    """All partitions of one gateway; creates a partition on its first insert.

    ``version`` names what the vectors depend on (encoder, snapshot layout); a snapshot of
    another version is stale and ignored.
    """

    def __init__(self, settings: IndexSettings, *, version: str = "") -> None:
        self.settings = settings
        self.version = version
        self._partitions: dict[PartitionKey, PartitionIndex] = {}
        self._lock = threading.Lock()
        configure_faiss_threads(settings.search_threads)

    def partition(self, key: PartitionKey, limits: Limits | None = None) -> PartitionIndex:
        """The partition's index, created empty if new; limits update an existing one."""
        with self._lock:
            part = self._partitions.get(key)
            if part is None:
                part = PartitionIndex(key, self.settings, limits or Limits())
                self._partitions[key] = part
            elif limits is not None and limits != part.limits:
                part.limits = limits
            return part

    def get(self, key: PartitionKey) -> PartitionIndex | None:
        return self._partitions.get(key)

    def drain_evicted(self) -> dict[PartitionKey, list[str]]:
        """Refs evicted per partition since the last call (see ``PartitionIndex``)."""
        out: dict[PartitionKey, list[str]] = {}
        for key in self.keys():
            part = self._partitions.get(key)
            if part is not None and (evicted := part.drain_evicted()):
                out[key] = evicted
        return out

    def keys(self) -> list[PartitionKey]:
        with self._lock:
            return list(self._partitions)

    def search(
        self, key: PartitionKey, vectors: np.ndarray, k: int, *, now: float | None = None
    ) -> list[list[Hit]]:
        """Search one partition only; an unknown partition has no hits."""
        part = self._partitions.get(key)
        if part is None:
            return [[] for _ in range(len(as_matrix(vectors, self.settings.dimensions)))]
        return part.search(vectors, k, now=now)

    def add_records(
        self,
        records: Iterable[SemanticRecord],
        *,
        now: float | None = None,
        progress: str | None = None,
    ) -> int:
        """Add records (from a feed or a store), grouped by partition; returns how many.

        ``progress`` names a progress bar (on a terminal only) for long restores.
        """
        now = time.time() if now is None else now
        grouped: dict[PartitionKey, list[SemanticRecord]] = {}
        for record in records:
            if record.expires_at > now:
                grouped.setdefault(record.partition, []).append(record)
        added = 0
        bar = tqdm(
            total=sum(map(len, grouped.values())),
            desc=progress,
            unit="entry",
            disable=None if progress else True,
        )
        for key, group in grouped.items():
            part = self.partition(key)
            ids = part.add(
                [r.text for r in group],
                np.stack([r.vector_array() for r in group]),
                [r.payload_ref for r in group],
                [r.expires_at for r in group],
                created_at=[r.created_at for r in group],
                observations=[r.observations for r in group],
                now=now,
            )
            added += sum(1 for i in ids if i)
            bar.update(len(group))
        bar.close()
        return added

    def remove_partitions(self, predicate: Callable[[PartitionKey], bool]) -> int:
        """Drop whole partitions (a tenant purge, a retired model revision)."""
        with self._lock:
            doomed = [key for key in self._partitions if predicate(key)]
            for key in doomed:
                del self._partitions[key]
        return len(doomed)

    def maintain(self, now: float | None = None) -> None:
        for key in self.keys():
            found = self._partitions.get(key)
            if found is not None:
                found.maintain(now)

    def wait_idle(self) -> None:
        for part in list(self._partitions.values()):
            part.wait_idle()

    def snapshot(self, folder: Path | str) -> None:
        """Write every partition and a manifest to folder, replacing it atomically."""
        parts = [part for key in self.keys() if (part := self._partitions.get(key)) is not None]
        write_snapshot(folder, parts, self.version)

    def load(
        self,
        folder: Path | str,
        records: Iterable[SemanticRecord] = (),
        *,
        limits_for: Callable[[PartitionKey], Limits] | None = None,
        now: float | None = None,
    ) -> LoadReport:
        """Load a snapshot, then add the records it lacks.

        The records are the caller's durable copy of the entries (the exact tiers). A
        missing or stale snapshot (other format, other ``version``, unreadable partition)
        is ignored and its partitions are rebuilt from the records alone.
        """
        now = time.time() if now is None else now
        loaded, stale_reason = read_snapshot(
            folder, self.version, self.settings, limits_for or (lambda key: Limits()), now
        )
        with self._lock:
            self._partitions.update(loaded)
        report = LoadReport(loaded=len(loaded), stale_reason=stale_reason)
        loaded_keys = set(loaded)
        pending: list[SemanticRecord] = []
        rebuilt: set[PartitionKey] = set()
        for record in records:
            existing = self._partitions.get(record.partition)
            if existing is not None and existing.has_ref(record.payload_ref):
                continue
            if record.partition not in loaded_keys:
                rebuilt.add(record.partition)
            pending.append(record)
        if limits_for is not None:
            for key in rebuilt:
                self.partition(key, limits_for(key))
        report.records_added = self.add_records(
            pending, now=now, progress="semantic cache: rebuilding"
        )
        report.rebuilt = len(rebuilt)
        return report
