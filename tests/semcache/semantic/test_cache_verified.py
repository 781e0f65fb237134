"""A verified partition of SemanticCache over the real encoder: it explores, learns from
judged observations, then serves; its observations survive a crash and go with a purge."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder
from semcache.semantic.index import SemanticIndex
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic.records import PartitionKey
from semcache.semantic.store import RecordStore
from semcache.semantic.verified.decisions import Action, Observation
from semcache.semantic_settings import SemanticRule
from tests.support.stepped_clock import SteppedClock

RULE = SemanticRule(
    enabled=True,
    mode="verified",
    threshold=0.6,
    min_threshold=0.6,
    max_error=0.05,
    min_observations=5,
    prior_weight=50.0,
    audit_rate=0.0,
)
CACHED = "What is the capital of France?"
ASKED = "what is the capital city of france"


def build(encoder: Encoder, directory: Path, clock: SteppedClock) -> SemanticCache:
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    store = RecordStore(directory / "records")
    return SemanticCache(encoder, index, store=store, clock=clock, uniform=lambda: 0.5)


@pytest.fixture
async def cache(encoder: Encoder, tmp_path: Path) -> AsyncIterator[SemanticCache]:
    semantic = build(encoder, tmp_path, SteppedClock(1_000_000.0))
    yield semantic
    await semantic.aclose()
    assert semantic.store is not None
    semantic.store.close()


def key_of(cache: SemanticCache) -> PartitionKey:
    return cache.partition_key(scope="tenant-a", model_revision="m@1", task="chat", template="t")


async def learn(cache: SemanticCache, key: PartitionKey, n: int) -> None:
    for i in range(n):
        found = await cache.verified_lookup(key, ASKED, RULE)
        assert found is not None
        match, decision = found
        assert decision.action is Action.EXPLORE
        observation = Observation(similarity=match.similarity, correct=True, at=float(i))
        assert await cache.observe(key, match.payload_ref, observation)


async def test_a_verified_partition_explores_learns_then_serves(cache: SemanticCache) -> None:
    key = key_of(cache)
    await cache.insert(key, [CACHED], ["ref-paris"], 600, rule=RULE)
    await learn(cache, key, RULE.min_observations)
    found = await cache.verified_lookup(key, ASKED, RULE)
    assert found is not None
    match, decision = found
    assert decision.action is Action.EXPLOIT and match.payload_ref == "ref-paris"
    assert decision.p_correct >= 1 - RULE.max_error
    # Below the floor there is no candidate at all.
    assert await cache.verified_lookup(key, "Recipe for banana bread", RULE) is None


async def test_observations_survive_a_crash_and_go_with_a_purge(
    encoder: Encoder, tmp_path: Path
) -> None:
    clock = SteppedClock(1_000_000.0)
    first = build(encoder, tmp_path, clock)
    key = key_of(first)
    await first.insert(key, [CACHED], ["ref-paris"], 600, rule=RULE)
    await first.snapshot(tmp_path / "snapshot")  # written before any observation
    await learn(first, key, RULE.min_observations)
    # No shutdown, no later snapshot: the process dies here.
    second = build(encoder, tmp_path, clock)
    try:
        await second.load(tmp_path / "snapshot")
        part = second.index.get(key)
        assert part is not None
        assert len(part.observations_of("ref-paris")) == RULE.min_observations
        found = await second.verified_lookup(key, ASKED, RULE)
        assert found is not None and found[1].action is Action.EXPLOIT

        await second.purge(lambda k: k.scope == "tenant-a")
        assert await second.verified_lookup(key, ASKED, RULE) is None
        await second.insert(key, [CACHED], ["ref-paris"], 600, rule=RULE)
        found = await second.verified_lookup(key, ASKED, RULE)
        assert found is not None and found[1].action is Action.EXPLORE
        assert second.index.get(key) is not None
        assert second.index.get(key).observations_of("ref-paris") == []  # type: ignore[union-attr]
    finally:
        await second.aclose()
        await first.aclose()
        for c in (first, second):
            assert c.store is not None
            c.store.close()


def test_explores_are_capped_per_partition_per_minute(cache: SemanticCache) -> None:
    key = key_of(cache)
    other = cache.partition_key(scope="tenant-b", model_revision="m@1", task="chat", template="t")
    assert [cache.take_explore(key, 2) for _ in range(3)] == [True, True, False]
    assert cache.take_explore(other, 2)  # another partition has its own budget
    assert isinstance(cache.clock, SteppedClock)
    cache.clock.now += 60
    assert cache.take_explore(key, 2)
