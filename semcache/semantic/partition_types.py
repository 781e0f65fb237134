"""The value types of a partition index: build settings, per-rule limits, a search hit, its
stats, and the state a snapshot keeps beside the FAISS index."""

from __future__ import annotations

from typing import Literal

import msgspec

from semcache.semantic.records import IndexEntry, PartitionKey

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


class PartitionState(msgspec.Struct, kw_only=True):
    """What a partition holds besides its FAISS index (what a snapshot keeps next to it)."""

    key: PartitionKey
    kind: IndexKind
    next_id: int
    hidden: list[int]
    """Ids still in the FAISS index whose entries are gone."""
    entries: list[IndexEntry]
