"""One FAISS partition: flat -> HNSW, expiry, tombstones, eviction, the HNSW beam."""

from __future__ import annotations

import numpy as np

from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import Limits
from semcache.semantic.verified.decisions import Action, Observation, VerifiedParams
from tests.semcache.semantic.index_helpers import DIM, NOW, fill, key, settings, unit_vectors


def test_flat_switches_to_hnsw_and_keeps_answers() -> None:
    part = PartitionIndex(
        key(), settings(hnsw_ef_search=256), Limits(ann_after=150, max_entries=10_000)
    )
    vectors = unit_vectors(140, seed=2)
    fill(part, vectors)
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
    part = PartitionIndex(
        key(), settings(background=True), Limits(ann_after=100, max_entries=10_000)
    )
    vectors = unit_vectors(300, seed=4)
    fill(part, vectors[:200])
    # Added while the HNSW build may still run: must be in the new index too.
    part.add(["late"], vectors[200:201], ["late-ref"], [NOW + 100], now=NOW)
    part.wait_idle()
    assert part.kind == "hnsw"
    assert part.search(vectors[200:201], 1, now=NOW)[0][0].entry.payload_ref == "late-ref"
    assert len(part) == 201


def test_expired_entries_are_not_served_and_their_vectors_removed() -> None:
    part = PartitionIndex(key(), settings(), Limits())
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
    part = PartitionIndex(
        key(), settings(tombstone_fraction=0.2), Limits(ann_after=50, max_entries=10_000)
    )
    vectors = unit_vectors(200, seed=6)
    fill(part, vectors)
    assert part.kind == "hnsw"
    removed = part.remove_refs([f"{part.key.digest()}:{i}" for i in range(30)], now=NOW)
    assert removed == 30
    stats = part.stats()
    assert stats.hidden == 30  # below 20 %: tombstones, not served
    assert all(
        not hit.entry.payload_ref.endswith(tuple(f":{i}" for i in range(30)))
        for row in part.search(vectors[:30], 5, now=NOW)
        for hit in row
    )
    part.remove_refs([f"{part.key.digest()}:{i}" for i in range(30, 60)], now=NOW)
    stats = part.stats()
    assert stats.hidden == 0  # past 20 %: rebuilt without them
    assert stats.vectors == stats.entries == 140


def test_size_bound_evicts_oldest_first() -> None:
    part = PartitionIndex(key(), settings(), Limits(ann_after=1000, max_entries=50))
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
    part = PartitionIndex(key(), settings(), Limits())
    v = unit_vectors(1, seed=9)
    first = part.add(["a"], v, ["ref"], [NOW + 10], now=NOW)
    second = part.add(["a"], v, ["ref"], [NOW + 100], now=NOW)
    assert first == second
    assert len(part) == 1
    assert part.search(v, 1, now=NOW + 50)[0][0].entry.payload_ref == "ref"


def test_hnsw_beam_widens_with_partition_size_up_to_its_cap() -> None:
    part = PartitionIndex(
        key(),
        settings(hnsw_ef_search=16, hnsw_ef_base_entries=100, hnsw_ef_growth=1.0, hnsw_ef_max=48),
        Limits(ann_after=10, max_entries=10_000),
    )
    fill(part, unit_vectors(80, seed=5))
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


def test_a_verified_entry_is_decided_on_its_neighbourhoods_prior() -> None:
    """Two workloads in one partition: 100 entries whose answers were right at cosine 0.97,
    20 elsewhere whose answers were wrong there. A new entry among the 20 is served on the
    whole partition's prior, and explored on its 16 neighbours'."""
    part = PartitionIndex(key(task="chat"), settings(), Limits())
    rng = np.random.default_rng(7)
    centres = unit_vectors(2, seed=6)

    def around(centre: np.ndarray, n: int) -> np.ndarray:
        x = centre + 0.05 * rng.standard_normal((n, DIM)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def region(name: str, vectors: np.ndarray, obs: list[list[Observation]]) -> None:
        n = len(vectors)
        refs = [f"{name}{i}" for i in range(n)]
        part.add(refs, vectors, refs, [NOW + 100] * n, observations=obs, now=NOW)

    right = [Observation(similarity=0.97, correct=True, at=float(i)) for i in range(5)]
    region("paraphrase", around(centres[0], 100), [right] * 100)
    wrong = [[Observation(similarity=0.97, correct=False, at=float(i))] for i in range(19)]
    region("template", around(centres[1], 20), [*wrong, []])  # template19: no observation

    def action(neighbours: int) -> Action:
        params = VerifiedParams(max_error=0.05, prior_neighbours=neighbours)
        decision = part.decide("template19", 0.97, params, uniform=0.5, now=NOW)
        assert decision is not None
        return decision.action

    assert action(0) is Action.EXPLOIT  # 500 right against 19 wrong, pooled
    assert action(16) is Action.EXPLORE  # its neighbours were wrong at 0.97
    assert action(500) is Action.EXPLOIT  # more neighbours than entries: the partition
