"""The policies of the stream evaluation replayed on one stream, and the bounds on any policy.

Each policy sees the same stream, as requests to one cache partition:

- static: the nearest entry is served when its score reaches a fixed threshold, else the
  request is a miss and its question becomes an entry;
- verified (``semcache.semantic.verified``): the nearest entry at or above the candidate
  floor is served or explored; an explored request is judged, the observation is added to
  the entry, and its question becomes an entry of its own when the judge says the cached
  answer was wrong.

Error rate is the share of wrong answers among those served; the share of wrong answers
among all requests (vCache's error rate) is kept beside it. ``ceiling`` is how far any
policy could go on a stream, whatever its decision rule.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from semcache.semantic.verified import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
)
from semcache.tuning.calibrate import wilson_lower
from semcache.tuning.stream_build import Stream

Score = Callable[[int, int], float]
"""Score of (request, entry), both as positions in the stream."""


class Outcome(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    hits: int
    wrong: int
    explores: int
    """Requests sent to the backend although an entry was a candidate (judged)."""
    informed: int = 0
    """Verified: decisions on an entry that had judged observations of its own."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        return self.wrong / self.hits if self.hits else 0.0

    @property
    def wrong_per_request(self) -> float:
        """Wrong answers among all requests (vCache's error rate)."""
        return self.wrong / self.requests if self.requests else 0.0

    @property
    def error_upper(self) -> float:
        """Upper end of the error rate's Wilson interval (one-sided 95 %)."""
        return 1.0 - wilson_lower(self.hits - self.wrong, self.hits)

    @property
    def explore_rate(self) -> float:
        return self.explores / self.requests if self.requests else 0.0


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
    hits = wrong = explores = informed = 0
    for i in range(len(stream.texts)):
        j = _nearest(sims, i, entries)
        if j is None or sims[i, j] < floor:
            entries.append(i)
            continue
        s = score(i, j)
        own = observations.get(j, [])
        informed += bool(own)
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
        informed=informed,
    )


def repeats(stream: Stream) -> int:
    """Requests whose cluster was asked before: the most answers any cache can serve right."""
    seen: set[int] = set()
    count = 0
    for cluster in stream.cluster:
        count += cluster in seen
        seen.add(cluster)
    return count


def ceiling(stream: Stream, max_error: float, *, per_request: bool = False) -> int:
    """The most answers any policy could serve with its error at most ``max_error``: every
    repeat served right, plus ``max_error`` of the served wrong (``r / (1 - d)``), or with
    ``per_request`` (vCache's error rate) ``max_error`` of all requests wrong (``r + d n``)."""
    if not stream.cluster:
        return 0
    right, n = repeats(stream), len(stream.texts)
    most = right + int(max_error * n) if per_request else int(right / (1.0 - max_error))
    return min(n - 1, most)


def best_static(
    outcomes: Sequence[Outcome], max_error: float, *, per_request: bool = False
) -> Outcome | None:
    """Of static runs on one stream, the one with the most hits whose realized error (among
    answers served, or with ``per_request`` among all requests) is at most max_error (tuned
    after the fact: the most favourable static setting)."""
    best: Outcome | None = None
    for out in outcomes:
        error = out.wrong_per_request if per_request else out.error_rate
        if out.hits and error <= max_error and (best is None or out.hits > best.hits):
            best = out
    return best


def _nearest(sims: np.ndarray, i: int, entries: list[int]) -> int | None:
    if not entries:
        return None
    row = sims[i, entries]
    return entries[int(np.argmax(row))]
