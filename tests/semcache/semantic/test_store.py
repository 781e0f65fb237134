"""Crash safety of the semantic index (durable records, reconciled with the snapshot), and
the label margin that guards classification hits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder
from semcache.semantic.index import SemanticIndex
from semcache.semantic.items import label_margin
from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic.records import PartitionKey
from semcache.semantic.store import RecordStore
from semcache.semantic_settings import SemanticRule
from tests.support.stepped_clock import SteppedClock

RULE = SemanticRule(enabled=True, threshold=0.99, min_threshold=0.8)
NOW = 1_000_000.0


def unit_vectors(n: int, seed: int, dim: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class Gateway:
    """One gateway's semantic cache over a data directory; ``crash`` drops it unsaved."""

    def __init__(
        self,
        encoder: Encoder,
        folder: Path,
        clock: SteppedClock,
        verifier: PairVerifier | None = None,
    ) -> None:
        self.store = RecordStore(folder / "records")
        index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
        self.cache = SemanticCache(encoder, index, verifier=verifier, store=self.store, clock=clock)
        self.snapshot_dir = folder / "snapshot"

    def key(self, scope: str) -> PartitionKey:
        return self.cache.partition_key(scope=scope, model_revision="r", task="t", template="x")

    def refs(self, scope: str) -> set[str]:
        part = self.cache.index.get(self.key(scope))
        return set(part.payload_refs()) if part is not None else set()

    def crash(self) -> None:
        self.store.close()  # what a kill -9 leaves: the records, no new snapshot


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock(NOW)


async def insert(gw: Gateway, scope: str, refs: list[str], seed: int, ttl: float = 100.0) -> None:
    vectors = unit_vectors(len(refs), seed, gw.cache.encoder.dimensions)
    await gw.cache.insert(gw.key(scope), refs, refs, ttl, rule=RULE, vectors=vectors)


async def test_no_snapshot_rebuilds_every_partition_from_the_records(
    encoder: Encoder, tmp_path: Path, clock: SteppedClock
) -> None:
    one = Gateway(encoder, tmp_path, clock)
    await insert(one, "tenant-a", ["a1", "a2"], seed=1)
    await insert(one, "tenant-b", ["b1"], seed=2)
    one.crash()

    two = Gateway(encoder, tmp_path, clock)
    report = await two.cache.load(two.snapshot_dir)
    assert (report.loaded, report.rebuilt, report.records_added) == (0, 2, 3)
    assert report.stale_reason == "no snapshot"
    assert two.refs("tenant-a") == {"a1", "a2"}
    assert two.refs("tenant-b") == {"b1"}
    query = unit_vectors(2, 1, encoder.dimensions)
    (match, _) = await two.cache.lookup(two.key("tenant-a"), ["q", "r"], RULE, vectors=query)
    assert match is not None and match.payload_ref == "a1"
    (other,) = await two.cache.lookup(two.key("tenant-b"), ["q"], RULE, vectors=query[:1])
    assert other is None  # tenant-b holds b1 only
    two.crash()


async def test_a_stale_snapshot_is_reconciled_with_the_records(
    encoder: Encoder, tmp_path: Path, clock: SteppedClock
) -> None:
    one = Gateway(encoder, tmp_path, clock)
    await insert(one, "tenant-a", ["a1", "a2"], seed=1)
    await one.cache.snapshot(one.snapshot_dir)
    await insert(one, "tenant-a", ["a3"], seed=3)  # after the snapshot
    await one.cache.remove(one.key("tenant-a"), ["a1"])  # after the snapshot
    one.crash()

    two = Gateway(encoder, tmp_path, clock)
    report = await two.cache.load(two.snapshot_dir)
    assert (report.loaded, report.records_added, report.dropped) == (1, 1, 1)
    assert two.refs("tenant-a") == {"a2", "a3"}
    two.crash()


async def test_expired_records_are_not_resurrected(
    encoder: Encoder, tmp_path: Path, clock: SteppedClock
) -> None:
    one = Gateway(encoder, tmp_path, clock)
    await insert(one, "tenant-a", ["short"], seed=1, ttl=10)
    await one.cache.snapshot(one.snapshot_dir)
    await insert(one, "tenant-a", ["short2"], seed=2, ttl=10)
    await insert(one, "tenant-a", ["long"], seed=3, ttl=1000)
    one.crash()

    clock.now += 60
    two = Gateway(encoder, tmp_path, clock)
    await two.cache.load(two.snapshot_dir)
    assert two.refs("tenant-a") == {"long"}
    two.crash()


async def test_evicted_and_purged_entries_stay_gone(
    encoder: Encoder, tmp_path: Path, clock: SteppedClock
) -> None:
    small = SemanticRule(enabled=True, threshold=0.99, max_entries=2)
    one = Gateway(encoder, tmp_path, clock)
    vectors = unit_vectors(3, 1, encoder.dimensions)
    for n in range(3):  # the oldest is evicted by max_entries
        clock.now += 1
        await one.cache.insert(
            one.key("tenant-a"), [f"a{n}"], [f"a{n}"], 100.0, rule=small, vectors=vectors[n : n + 1]
        )
    await insert(one, "tenant-b", ["b1"], seed=2)
    assert one.refs("tenant-a") == {"a1", "a2"}
    await one.cache.purge(lambda key: key.scope == "tenant-b")
    assert len(one.store) == 2
    one.crash()

    two = Gateway(encoder, tmp_path, clock)
    report = await two.cache.load(two.snapshot_dir)
    assert report.records_added == 2
    assert two.refs("tenant-a") == {"a1", "a2"}
    assert two.cache.index.get(two.key("tenant-b")) is None
    two.crash()


async def test_records_of_another_matcher_are_dropped(
    encoder: Encoder, verifier: PairVerifier, tmp_path: Path, clock: SteppedClock
) -> None:
    """A retrained verifier (another matcher version) starts from empty partitions."""
    one = Gateway(encoder, tmp_path, clock)
    await insert(one, "tenant-a", ["a1"], seed=1)
    await one.cache.snapshot(one.snapshot_dir)
    one.crash()

    two = Gateway(encoder, tmp_path, clock, verifier=verifier)
    assert two.cache.matcher_version != one.cache.matcher_version
    await two.cache.load(two.snapshot_dir)
    assert two.cache.index.keys() == []
    assert len(two.store) == 0
    two.crash()


def test_label_margin_is_the_log_odds_of_the_top_two_labels() -> None:
    assert label_margin([0.5, 0.5]) == 0.0
    assert label_margin([0.2, 0.8]) == pytest.approx(math.log(4.0))
    assert label_margin([0.7, 0.2, 0.1]) == pytest.approx(math.log(3.5))
    assert label_margin([1.0]) == math.inf and label_margin([1.0, 0.0]) == math.inf
