"""The FAISS partitions: isolation, flat -> HNSW, expiry, eviction, persistence."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from semcache.semantic.index import IndexSettings, Limits, SemanticIndex
from semcache.semantic.records import PartitionKey

DIM = 32
NOW = 1_000_000.0


def unit_vectors(n: int, seed: int, dim: int = DIM) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def settings(**overrides: object) -> IndexSettings:
    base: dict[str, object] = {"dimensions": DIM, "background": False, "use_gpu": False}
    base.update(overrides)
    return IndexSettings(**base)  # type: ignore[arg-type]


def key(scope: str = "t1", revision: str = "r1", task: str = "embeddings") -> PartitionKey:
    return PartitionKey(scope=scope, model_revision=revision, task=task, template="tpl")


def fill(index: SemanticIndex, k: PartitionKey, vectors: np.ndarray, ttl: float = 100.0) -> None:
    n = len(vectors)
    index.partition(k).add(
        [f"text {i}" for i in range(n)],
        vectors,
        [f"{k.digest()}:{i}" for i in range(n)],
        [NOW + ttl] * n,
        now=NOW,
    )


def test_identical_texts_never_cross_partitions() -> None:
    """Randomized: many partitions hold identical vectors; every hit is from the queried one."""
    rng = random.Random(7)
    index = SemanticIndex(settings())
    fields = {
        "scope": [f"tenant-{i}" for i in range(4)],
        "model_revision": ["rev-a", "rev-b", "rev-c"],
        "task": ["chat", "embeddings", "classification"],
        "template": ["t0", "t1"],
    }
    keys = {
        PartitionKey(**{name: rng.choice(values) for name, values in fields.items()})
        for _ in range(60)
    }
    shared = unit_vectors(40, seed=1)
    for k in keys:
        count = rng.randint(5, 40)
        ids = index.partition(k).add(
            [f"same text {i}" for i in range(count)],
            shared[:count],
            [f"{k.digest()}:{i}" for i in range(count)],
            [NOW + 60] * count,
            now=NOW,
        )
        assert all(ids)
    unknown = PartitionKey(scope="nobody", model_revision="rev-a", task="chat", template="t0")
    assert index.search(unknown, shared[:3], 5, now=NOW) == [[], [], []]
    cross = 0
    total = 0
    for k in keys:
        queries = shared[rng.sample(range(40), 10)]
        for row in index.search(k, queries, 8, now=NOW):
            for hit in row:
                total += 1
                cross += not hit.entry.payload_ref.startswith(k.digest() + ":")
    assert total > 0
    assert cross == 0


def test_flat_switches_to_hnsw_and_keeps_answers() -> None:
    index = SemanticIndex(settings(hnsw_ef_search=256))
    k = key()
    part = index.partition(k, Limits(ann_after=150, max_entries=10_000))
    vectors = unit_vectors(140, seed=2)
    fill(index, k, vectors)
    assert part.kind == "flat"
    before = [row[0].entry.id for row in part.search(vectors, 1, now=NOW)]
    more = unit_vectors(60, seed=3)
    part.add(
        [f"more {i}" for i in range(60)],
        more,
        [f"m{i}" for i in range(60)],
        [NOW + 100] * 60,
        now=NOW,
    )
    assert part.kind == "hnsw"
    after = [row[0].entry.id for row in part.search(vectors, 1, now=NOW)]
    assert after == before
    assert [row[0].entry.payload_ref for row in part.search(more, 1, now=NOW)] == [
        f"m{i}" for i in range(60)
    ]


def test_background_switch_serves_meanwhile_and_keeps_late_entries() -> None:
    index = SemanticIndex(settings(background=True))
    k = key()
    part = index.partition(k, Limits(ann_after=100, max_entries=10_000))
    vectors = unit_vectors(300, seed=4)
    fill(index, k, vectors[:200])
    # Added while the HNSW build may still run: must be in the new index too.
    part.add(["late"], vectors[200:201], ["late-ref"], [NOW + 100], now=NOW)
    part.wait_idle()
    assert part.kind == "hnsw"
    assert part.search(vectors[200:201], 1, now=NOW)[0][0].entry.payload_ref == "late-ref"
    assert len(part) == 201


def test_expired_entries_are_not_served_and_their_vectors_removed() -> None:
    index = SemanticIndex(settings())
    k = key()
    part = index.partition(k)
    vectors = unit_vectors(20, seed=5)
    part.add(
        [f"s{i}" for i in range(10)],
        vectors[:10],
        [f"short{i}" for i in range(10)],
        [NOW + 10] * 10,
        now=NOW,
    )
    part.add(
        [f"l{i}" for i in range(10)],
        vectors[10:],
        [f"long{i}" for i in range(10)],
        [NOW + 1000] * 10,
        now=NOW,
    )
    later = NOW + 11
    for row in part.search(vectors[:10], 3, now=later):
        assert all(hit.entry.payload_ref.startswith("long") for hit in row)
    part.maintain(later)
    stats = part.stats()
    assert stats.entries == 10
    assert stats.vectors == 10  # flat: vectors really removed
    assert stats.hidden == 0


def test_hnsw_tombstones_are_compacted() -> None:
    index = SemanticIndex(settings(tombstone_fraction=0.2))
    k = key()
    part = index.partition(k, Limits(ann_after=50, max_entries=10_000))
    vectors = unit_vectors(200, seed=6)
    fill(index, k, vectors)
    assert part.kind == "hnsw"
    removed = part.remove_refs([f"{k.digest()}:{i}" for i in range(30)], now=NOW)
    assert removed == 30
    stats = part.stats()
    assert stats.hidden == 30  # below 20 %: tombstones, not served
    assert all(
        not hit.entry.payload_ref.endswith(tuple(f":{i}" for i in range(30)))
        for row in part.search(vectors[:30], 5, now=NOW)
        for hit in row
    )
    part.remove_refs([f"{k.digest()}:{i}" for i in range(30, 60)], now=NOW)
    stats = part.stats()
    assert stats.hidden == 0  # past 20 %: rebuilt without them
    assert stats.vectors == stats.entries == 140


def test_size_bound_evicts_oldest_first() -> None:
    index = SemanticIndex(settings())
    k = key()
    part = index.partition(k, Limits(ann_after=1000, max_entries=50))
    vectors = unit_vectors(120, seed=8)
    for start in range(0, 120, 7):
        block = range(start, min(start + 7, 120))
        part.add(
            [f"t{i}" for i in block],
            vectors[list(block)],
            [f"r{i}" for i in block],
            [NOW + 100] * len(block),
            now=NOW,
        )
    stats = part.stats()
    assert stats.entries == 50
    assert stats.vectors == 50
    refs = {hit.entry.payload_ref for row in part.search(vectors, 1, now=NOW) for hit in row}
    assert refs <= {f"r{i}" for i in range(70, 120)}
    assert not part.has_ref("r0")
    assert part.has_ref("r119")


def test_same_payload_ref_only_extends_expiry() -> None:
    index = SemanticIndex(settings())
    part = index.partition(key())
    v = unit_vectors(1, seed=9)
    first = part.add(["a"], v, ["ref"], [NOW + 10], now=NOW)
    second = part.add(["a"], v, ["ref"], [NOW + 100], now=NOW)
    assert first == second
    assert len(part) == 1
    assert part.search(v, 1, now=NOW + 50)[0][0].entry.payload_ref == "ref"


def test_snapshot_round_trip(tmp_path: Path) -> None:
    index = SemanticIndex(settings(), version="enc-1")
    flat_key, hnsw_key = key("a"), key("b")
    vectors = unit_vectors(120, seed=10)
    fill(index, flat_key, vectors[:40])
    index.partition(hnsw_key, Limits(ann_after=30, max_entries=1000))
    fill(index, hnsw_key, vectors[40:])
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
    fill(index, k, vectors)
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
    fill(index, k, vectors[:10])
    index.snapshot(tmp_path / "snap")
    index.partition(k).add(["new"], vectors[10:11], ["new-ref"], [NOW + 100], now=NOW)
    restored = SemanticIndex(settings(), version="v")
    report = restored.load(tmp_path / "snap", index.partition(k).records(), now=NOW)
    assert (report.loaded, report.records_added) == (1, 1)
    assert restored.search(k, vectors[10:11], 1, now=NOW)[0][0].entry.payload_ref == "new-ref"


def test_hnsw_beam_widens_with_partition_size_up_to_its_cap() -> None:
    index = SemanticIndex(
        settings(hnsw_ef_search=16, hnsw_ef_base_entries=100, hnsw_ef_growth=1.0, hnsw_ef_max=48)
    )
    k = key()
    part = index.partition(k, Limits(ann_after=10, max_entries=10_000))
    fill(index, k, unit_vectors(80, seed=5))
    assert part.kind == "hnsw" and part.ef_search() == 16  # at or below the base size
    more = unit_vectors(120, seed=6)
    part.add(
        [f"m{i}" for i in range(120)],
        more,
        [f"m{i}" for i in range(120)],
        [NOW + 100] * 120,
        now=NOW,
    )
    assert part.ef_search() == 32  # 200 entries: twice the base, growth 1
    extra = unit_vectors(400, seed=7)
    part.add(
        [f"x{i}" for i in range(400)],
        extra,
        [f"x{i}" for i in range(400)],
        [NOW + 100] * 400,
        now=NOW,
    )
    assert part.ef_search() == 48  # capped
    # The widened beam is what the search uses: every stored vector finds itself.
    hits = part.search(extra[:50], 1, now=NOW)
    assert [row[0].entry.payload_ref for row in hits] == [f"x{i}" for i in range(50)]
