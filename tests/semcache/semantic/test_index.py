"""The semantic index: partitions are hard boundaries, whatever their vectors."""

from __future__ import annotations

import random

from semcache.semantic.index import SemanticIndex
from semcache.semantic.records import PartitionKey
from tests.semcache.semantic.index_helpers import NOW, settings, unit_vectors


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
