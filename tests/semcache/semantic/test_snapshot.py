"""Snapshots of the semantic index: the round trip, stale snapshots, records newer than one."""

from __future__ import annotations

from pathlib import Path

import pytest

from semcache.semantic.index import SemanticIndex
from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import Limits
from semcache.semantic.snapshot import StaleSnapshot, read_partition, write_partition
from tests.semcache.semantic.index_helpers import NOW, fill, key, settings, unit_vectors


def test_snapshot_round_trip(tmp_path: Path) -> None:
    index = SemanticIndex(settings(), version="enc-1")
    flat_key, hnsw_key = key("a"), key("b")
    vectors = unit_vectors(120, seed=10)
    fill(index.partition(flat_key), vectors[:40])
    index.partition(hnsw_key, Limits(ann_after=30, max_entries=1000))
    fill(index.partition(hnsw_key), vectors[40:])
    index.partition(hnsw_key).remove_refs(
        [f"{hnsw_key.digest()}:0"], now=NOW
    )  # a tombstone survives
    expected = {k: index.search(k, vectors, 3, now=NOW) for k in (flat_key, hnsw_key)}
    index.snapshot(tmp_path / "snap")

    restored = SemanticIndex(settings(), version="enc-1")
    report = restored.load(tmp_path / "snap", now=NOW)
    assert (report.loaded, report.rebuilt) == (2, 0)
    assert restored.partition(hnsw_key).kind == "hnsw"
    for k, rows in expected.items():
        got = restored.search(k, vectors, 3, now=NOW)
        assert [[h.entry.payload_ref for h in r] for r in got] == [
            [h.entry.payload_ref for h in r] for r in rows
        ]


@pytest.mark.parametrize("damage", ["missing", "version", "corrupt"])
def test_stale_snapshot_is_rebuilt_from_records(tmp_path: Path, damage: str) -> None:
    index = SemanticIndex(settings(), version="enc-1")
    k = key()
    vectors = unit_vectors(30, seed=11)
    fill(index.partition(k), vectors)
    records = index.partition(k).records()
    snap = tmp_path / "snap"
    index.snapshot(snap)
    version = "enc-1"
    if damage == "missing":
        snap = tmp_path / "nothing-here"
    elif damage == "version":
        version = "enc-2"
    else:
        (snap / k.digest() / "index.faiss").write_bytes(b"not a faiss index")

    restored = SemanticIndex(settings(), version=version)
    report = restored.load(snap, records, now=NOW)
    assert report.loaded == 0
    assert report.rebuilt == 1
    assert report.records_added == 30
    assert report.stale_reason
    top = restored.search(k, vectors, 1, now=NOW)
    assert [row[0].entry.payload_ref for row in top] == [f"{k.digest()}:{i}" for i in range(30)]


def test_snapshot_plus_newer_records(tmp_path: Path) -> None:
    """Records written after the snapshot (kept by the exact tiers) are added on load."""
    index = SemanticIndex(settings(), version="v")
    k = key()
    vectors = unit_vectors(20, seed=12)
    fill(index.partition(k), vectors[:10])
    index.snapshot(tmp_path / "snap")
    index.partition(k).add(["new"], vectors[10:11], ["new-ref"], [NOW + 100], now=NOW)
    restored = SemanticIndex(settings(), version="v")
    report = restored.load(tmp_path / "snap", index.partition(k).records(), now=NOW)
    assert (report.loaded, report.records_added) == (1, 1)
    assert restored.search(k, vectors[10:11], 1, now=NOW)[0][0].entry.payload_ref == "new-ref"


def test_one_partition_round_trip_keeps_entries_and_tombstones(tmp_path: Path) -> None:
    part = PartitionIndex(key(), settings(), Limits(ann_after=30, max_entries=1000))
    fill(part, unit_vectors(60, seed=13))
    part.remove_refs([f"{part.key.digest()}:0"], now=NOW)
    write_partition(part, tmp_path)
    back = read_partition(tmp_path, settings(), part.limits, NOW)
    assert back.stats() == part.stats() and back.stats().hidden == 1
    assert back.payload_refs() == part.payload_refs()
    with pytest.raises(StaleSnapshot, match="dimensions"):
        read_partition(tmp_path, settings(dimensions=16), part.limits, NOW)
