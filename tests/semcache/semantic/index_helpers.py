"""Helpers of the semantic index tests: unit vectors, small settings, keys, filled partitions."""

from __future__ import annotations

import numpy as np

from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import IndexSettings
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


def fill(part: PartitionIndex, vectors: np.ndarray, ttl: float = 100.0) -> None:
    """Add one entry per vector, with the payload refs ``<partition digest>:<row>``."""
    n = len(vectors)
    part.add(
        [f"text {i}" for i in range(n)],
        vectors,
        [f"{part.key.digest()}:{i}" for i in range(n)],
        [NOW + ttl] * n,
        now=NOW,
    )
