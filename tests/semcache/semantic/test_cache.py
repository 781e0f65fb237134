"""SemanticCache end to end over the real encoder, index and verifier."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder
from semcache.semantic.index import SemanticIndex
from semcache.semantic.match import effective_threshold
from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic.records import PartitionKey
from semcache.semantic_settings import SemanticRule

RULE = SemanticRule(enabled=True, threshold=0.85, min_threshold=0.8, ann_after=10_000)
CACHED = [
    "How do I reset my password?",
    "What is the capital of France?",
    "Best way to learn the guitar as an adult",
]


@pytest.fixture
async def cache(encoder: Encoder, verifier: PairVerifier) -> AsyncIterator[SemanticCache]:
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    semantic = SemanticCache(encoder, index, verifier=verifier)
    yield semantic
    await semantic.aclose()


def partition(
    cache: SemanticCache, scope: str = "tenant-a", task: str = "embeddings"
) -> PartitionKey:
    return cache.partition_key(scope=scope, model_revision="rev1", task=task, template="none")


async def test_near_duplicate_hits_and_unrelated_misses(cache: SemanticCache) -> None:
    key = partition(cache)
    await cache.insert(key, CACHED, ["ref-pw", "ref-paris", "ref-guitar"], 60, rule=RULE)
    matches = await cache.lookup(
        key,
        [
            "How can I reset my password?",
            "Recipe for banana bread",
            "what is the capital of france",
        ],
        RULE,
    )
    assert matches[0] is not None and matches[0].payload_ref == "ref-pw"
    assert matches[0].text == CACHED[0]
    assert matches[0].similarity >= RULE.threshold
    assert matches[0].verifier_prob is None  # the rule does not ask for the verifier
    assert matches[1] is None
    assert matches[2] is not None and matches[2].payload_ref == "ref-paris"


async def test_per_item_results_keep_input_order(cache: SemanticCache) -> None:
    key = partition(cache)
    texts = [f"Item number {i}: {word}" for i, word in enumerate(["alpha", "bravo", "charlie"])]
    await cache.insert(key, texts, [f"r{i}" for i in range(3)], 60, rule=RULE)
    queries = ["a fresh text nobody cached", texts[2], "another unseen question", texts[0]]
    matches = await cache.lookup(key, queries, RULE)
    assert [m.payload_ref if m else None for m in matches] == [None, "r2", None, "r0"]


async def test_a_request_may_tighten_but_never_loosen(cache: SemanticCache) -> None:
    key = partition(cache)
    await cache.insert(key, ["How do I reset my password?"], ["ref"], 60, rule=RULE)
    query = ["How can I reset my password?"]
    (loose,) = await cache.lookup(key, query, RULE)
    assert loose is not None
    (tight,) = await cache.lookup(key, query, RULE, tighten_threshold=0.999)
    assert tight is None
    # Asking for a lower threshold than the policy's changes nothing.
    assert effective_threshold(RULE, 0.1) == RULE.threshold
    assert effective_threshold(RULE, 0.95) == 0.95
    far = ["How do I change the wheel of my bicycle?"]
    assert await cache.lookup(key, far, RULE, tighten_threshold=0.0) == [None]


async def test_disabled_rule_never_hits(cache: SemanticCache) -> None:
    key = partition(cache)
    await cache.insert(key, CACHED, ["a", "b", "c"], 60, rule=RULE)
    off = SemanticRule(enabled=False)
    assert await cache.lookup(key, CACHED, off) == [None, None, None]


async def test_verifier_rejects_a_close_but_different_question(cache: SemanticCache) -> None:
    chat = SemanticRule(
        enabled=True, threshold=0.75, min_threshold=0.7, verifier=True, verifier_min_prob=0.9
    )
    key = partition(cache, task="chat")
    await cache.insert(key, ["How do I lose 10 kg in a month?"], ["ref-10"], 60, rule=chat)
    plain = SemanticRule(enabled=True, threshold=0.75, min_threshold=0.7)
    (by_cosine,) = await cache.lookup(key, ["How do I lose 30 kg in a month?"], plain)
    assert by_cosine is not None  # cosine alone would serve the wrong answer
    (verified,) = await cache.lookup(key, ["How do I lose 30 kg in a month?"], chat)
    assert verified is None
    (same,) = await cache.lookup(key, ["How do I lose 10 kg in one month?"], chat)
    assert same is not None and same.payload_ref == "ref-10"
    assert same.verifier_prob is not None and same.verifier_prob >= 0.9


async def test_partitions_isolate_tenants_and_models(cache: SemanticCache) -> None:
    """Randomized over real encodings: identical texts in many partitions never cross."""
    rng = random.Random(3)
    texts = ["What is the capital of France?", "How do I reset my password?"]
    keys = [
        cache.partition_key(
            scope=f"tenant-{rng.randrange(5)}",
            model_revision=f"rev-{rng.randrange(3)}",
            task=rng.choice(["chat", "embeddings", "classification"]),
            template=f"tpl-{rng.randrange(2)}",
        )
        for _ in range(20)
    ]
    vectors = await cache.encode(texts)
    for key in set(keys):
        refs = [f"{key.digest()}:{i}" for i in range(len(texts))]
        await cache.insert(key, texts, refs, 60, rule=RULE, vectors=vectors)
    for key in set(keys):
        matches = await cache.lookup(key, texts, RULE, vectors=vectors)
        assert [m.payload_ref if m else None for m in matches] == [
            f"{key.digest()}:{i}" for i in range(len(texts))
        ]


async def test_remove_and_purge(cache: SemanticCache) -> None:
    a, b = partition(cache, "tenant-a"), partition(cache, "tenant-b")
    for key in (a, b):
        await cache.insert(key, CACHED, ["x", "y", "z"], 60, rule=RULE)
    assert await cache.remove(a, ["x"]) == 1
    assert (await cache.lookup(a, CACHED[:1], RULE)) == [None]
    assert await cache.purge(lambda key: key.scope == "tenant-b") == 1
    assert await cache.lookup(b, CACHED, RULE) == [None, None, None]


def test_matcher_version_names_encoder_and_verifier(cache: SemanticCache) -> None:
    key = partition(cache)
    assert cache.encoder.version in key.matcher
    assert cache.verifier is not None and cache.verifier.version in key.matcher
