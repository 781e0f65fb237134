"""A stream evaluation of chat semantic caching on labelled pairs: verified vs static.

Labelled duplicate pairs become duplicate clusters (connected components of the pairs
labelled 1; a question in no such pair is a cluster of its own). The clusters' questions are
replayed once each, in a seeded random order, as requests to one cache partition; a cached
answer is right for a request when both questions are in one cluster (the label is the
judge). Each policy sees the same stream:

- static: the nearest entry is served when its score reaches a fixed threshold, else the
  request is a miss and its question becomes an entry;
- verified (``semcache.semantic.verified``): the nearest entry at or above the candidate
  floor is served or explored; an explored request is judged, the observation is added to
  the entry, and its question becomes an entry of its own when the judge says the cached
  answer was wrong.

The score is the cosine of the encoder's vectors, or the pair verifier's probability of the
nearest entry by cosine. Error rate is the share of wrong answers among those served.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from semcache.calibrate import wilson_lower
from semcache.semantic.pairs import Pair
from semcache.semantic.verified import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
)

Score = Callable[[int, int], float]
"""Score of (request, entry), both as positions in the stream."""


class Stream(msgspec.Struct, kw_only=True):
    texts: list[str]
    cluster: list[int]
    """Cluster id of each text (same id: the same question)."""


class Outcome(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    hits: int
    wrong: int
    explores: int
    """Requests sent to the backend although an entry was a candidate (judged)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        return self.wrong / self.hits if self.hits else 0.0

    @property
    def error_upper(self) -> float:
        """Upper end of the error rate's Wilson interval (one-sided 95 %)."""
        return 1.0 - wilson_lower(self.hits - self.wrong, self.hits)

    @property
    def explore_rate(self) -> float:
        return self.explores / self.requests if self.requests else 0.0


def build_stream(pairs: Sequence[Pair], *, limit: int | None, seed: int) -> Stream:
    """The questions of the pairs in a seeded random order, with their clusters.

    With ``limit``, whole components of the pairs (any label) are drawn until ``limit``
    questions are reached, so duplicates and hard negatives stay together.
    """
    everything = _components(pairs, lambda p: True)
    duplicates = _components(pairs, lambda p: p.label == 1)
    rng = random.Random(seed)
    groups: dict[str, list[str]] = {}
    for text, root in everything.items():
        groups.setdefault(root, []).append(text)
    roots = sorted(groups)
    rng.shuffle(roots)
    texts: list[str] = []
    for root in roots:
        if limit is not None and len(texts) >= limit:
            break
        texts.extend(sorted(groups[root]))
    rng.shuffle(texts)
    ids: dict[str, int] = {}
    cluster = [ids.setdefault(duplicates.get(t, t), len(ids)) for t in texts]
    return Stream(texts=texts, cluster=cluster)


def _components(pairs: Sequence[Pair], keep: Callable[[Pair], bool]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        a, b = find(pair.text_a), find(pair.text_b)
        if keep(pair) and a != b:
            low, high = sorted((a, b))
            parent[high] = low
    return {text: find(text) for text in list(parent)}


def run_static(stream: Stream, sims: np.ndarray, score: Score, threshold: float) -> Outcome:
    """A fixed threshold on the nearest entry's score (``sims``: the cosine matrix)."""
    entries: list[int] = []
    hits = wrong = 0
    for i in range(len(stream.texts)):
        j = _nearest(sims, i, entries)
        if j is not None and score(i, j) >= threshold:
            hits += 1
            wrong += stream.cluster[i] != stream.cluster[j]
            continue
        entries.append(i)
    return Outcome(
        policy=f"static {threshold:.3f}",
        requests=len(stream.texts),
        hits=hits,
        wrong=wrong,
        explores=0,
    )


def run_verified(
    stream: Stream,
    sims: np.ndarray,
    score: Score,
    params: VerifiedParams,
    *,
    floor: float,
    seed: int,
) -> Outcome:
    """The verified policy, its candidates the nearest entries with a cosine >= ``floor``."""
    rng = random.Random(seed)
    entries: list[int] = []
    observations: dict[int, list[Observation]] = {}
    prior = PartitionPrior()
    hits = wrong = explores = 0
    for i in range(len(stream.texts)):
        j = _nearest(sims, i, entries)
        if j is None or sims[i, j] < floor:
            entries.append(i)
            continue
        s = score(i, j)
        own = observations.get(j, [])
        decision = decide(s, own, prior, params, rng.random())
        correct = stream.cluster[i] == stream.cluster[j]
        if decision.action is Action.EXPLOIT:
            hits += 1
            wrong += not correct
            continue
        explores += 1
        kept, dropped = observed(own, Observation(similarity=s, correct=correct, at=float(i)))
        observations[j] = kept
        prior.add([kept[-1]])
        prior.remove(dropped)
        if not correct:
            entries.append(i)
    return Outcome(
        policy=f"verified {params.max_error:.2f}",
        requests=len(stream.texts),
        hits=hits,
        wrong=wrong,
        explores=explores,
    )


def best_static(outcomes: Sequence[Outcome], max_error: float) -> Outcome | None:
    """Of static runs on one stream, the one with the most hits whose realized error is at
    most max_error (tuned after the fact: the most favourable static setting)."""
    best: Outcome | None = None
    for out in outcomes:
        if out.hits and out.error_rate <= max_error and (best is None or out.hits > best.hits):
            best = out
    return best


def _nearest(sims: np.ndarray, i: int, entries: list[int]) -> int | None:
    if not entries:
        return None
    row = sims[i, entries]
    return entries[int(np.argmax(row))]
