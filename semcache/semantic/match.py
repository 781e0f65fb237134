"""What a semantic lookup serves: the ``Match``, the threshold rule, and the static choice
among a partition's nearest entries (confirmed by the pair verifier when the rule asks).

Threshold rule: the effective threshold is ``max(rule.threshold, requested)``. A request
may tighten (raise) the policy's threshold, never loosen it; ``rule.min_threshold`` is the
policy loader's lower bound on ``rule.threshold`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import Hit
from semcache.semantic_settings import SemanticRule

SLACK = 1e-5
"""Cosine of a text with itself is 1 up to float rounding; thresholds compare with this slack."""


class Match(msgspec.Struct, frozen=True, kw_only=True):
    """A cached entry that may answer the input text."""

    payload_ref: str
    similarity: float
    verifier_prob: float | None
    """The verifier's probability that both texts mean the same (None: not asked)."""
    text: str
    """The cached text whose answer is served."""


def effective_threshold(rule: SemanticRule, requested: float | None = None) -> float:
    """The policy threshold, raised (never lowered) by a request's own value."""
    threshold = rule.threshold if requested is None else max(rule.threshold, requested)
    return min(threshold, 1.0)


def match_of(hit: Hit, prob: float | None) -> Match:
    return Match(
        payload_ref=hit.entry.payload_ref,
        similarity=hit.similarity,
        verifier_prob=prob,
        text=hit.entry.text,
    )


def best_matches(
    part: PartitionIndex,
    texts: Sequence[str],
    vectors: np.ndarray,
    threshold: float,
    k: int,
    rule: SemanticRule,
    verifier: PairVerifier | None,
    now: float,
) -> list[Match | None]:
    """For each text, the nearest of its ``k`` nearest entries past the threshold, or with a
    ``verifier`` the one it gives the highest probability at or above the rule's
    ``verifier_min_prob`` (blocking)."""
    hits = part.search(vectors, k, now=now)
    passing = [[h for h in row if h.similarity >= threshold - SLACK] for row in hits]
    if verifier is None:
        return [match_of(row[0], None) if row else None for row in passing]
    # One batched verifier call for every (query, candidate) pair of the request.
    owners: list[int] = []
    candidates: list[Hit] = []
    for row_index, row in enumerate(passing):
        owners.extend([row_index] * len(row))
        candidates.extend(row)
    results: list[Match | None] = [None] * len(texts)
    if not candidates:
        return results
    candidate_vectors = part.vectors_of([hit.entry.id for hit in candidates])
    probs = verifier.probabilities(
        vectors[owners],
        candidate_vectors,
        [texts[i] for i in owners],
        [hit.entry.text for hit in candidates],
    )
    best: dict[int, tuple[float, Hit]] = {}
    for owner, hit, prob in zip(owners, candidates, probs.tolist(), strict=True):
        if prob >= rule.verifier_min_prob and (owner not in best or prob > best[owner][0]):
            best[owner] = (prob, hit)
    for owner, (prob, hit) in best.items():
        results[owner] = match_of(hit, prob)
    return results
