"""The lookup of a verified partition: its nearest candidate, the score the entry's curve is
learned over, the serve-or-explore decision, and the per-partition cap on judged explores.

Candidates are the nearest entries at or above the threshold (a floor here); with the
verifier on, the score is the verifier's probability instead of the cosine
(``semcache.semantic.verified.decisions`` holds the decision itself).
"""

from __future__ import annotations

import numpy as np

from semcache.semantic.match import SLACK, Match, match_of
from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.partition import PartitionIndex
from semcache.semantic.records import PartitionKey
from semcache.semantic.verified.decisions import Decision, VerifiedParams
from semcache.semantic_settings import SemanticRule


def verified_params(rule: SemanticRule) -> VerifiedParams:
    return VerifiedParams(
        max_error=rule.max_error,
        min_observations=rule.min_observations,
        prior_weight=rule.prior_weight,
        prior_bandwidth=rule.prior_bandwidth,
        audit_rate=rule.audit_rate,
        prior_neighbours=rule.prior_neighbours,
    )


def verified_candidate(
    part: PartitionIndex,
    text: str,
    vectors: np.ndarray,
    threshold: float,
    verifier: PairVerifier | None,
    params: VerifiedParams,
    uniform: float,
    now: float,
) -> tuple[Match, Decision] | None:
    """The nearest entry at or above ``threshold`` and whether to serve or explore it
    (None: no candidate, or it is gone); blocking."""
    (row,) = part.search(vectors, 1, now=now)
    if not row or row[0].similarity < threshold - SLACK:
        return None
    hit = row[0]
    prob: float | None = None
    if verifier is not None:
        prob = float(
            verifier.probabilities(
                vectors, part.vectors_of([hit.entry.id]), [text], [hit.entry.text]
            )[0]
        )
    score = prob if prob is not None else hit.similarity
    decision = part.decide(hit.entry.payload_ref, score, params, uniform, now=now)
    return (match_of(hit, prob), decision) if decision is not None else None


class ExploreBudget:
    """Judged explores per partition and minute, capped."""

    def __init__(self) -> None:
        self._explores: dict[PartitionKey, tuple[int, int]] = {}
        """Judged explores per partition in the current minute: (minute, count)."""

    def take(self, partition: PartitionKey, per_minute: int, now: float) -> bool:
        """Count one judged explore of the partition, unless its minute's cap is reached."""
        minute = int(now // 60)
        start, count = self._explores.get(partition, (minute, 0))
        if start != minute:
            count = 0
        if count >= per_minute:
            return False
        self._explores[partition] = (minute, count + 1)
        if len(self._explores) > 10_000:  # forget partitions idle since an earlier minute
            self._explores = {k: v for k, v in self._explores.items() if v[0] == minute}
        return True
