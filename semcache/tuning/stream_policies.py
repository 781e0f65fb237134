"""The policies of the stream evaluation replayed on one stream, and the bounds on any policy.

Each policy sees the same stream, as requests to one cache partition:

- static: the nearest entry is served when its score reaches a fixed threshold, else the
  request is a miss and its question becomes an entry;
- verified (``semcache.semantic.verified.decisions``): the nearest entry at or above the candidate
  floor is served or explored; an explored request is judged, the observation is added to
  the entry, and its question becomes an entry of its own when the judge says the cached
  answer was wrong.

Error rate is the share of wrong answers among those served; the share of wrong answers
among all requests (vCache's error rate) is kept beside it. ``ceiling`` is how far any
policy could go on a stream, whatever its decision rule.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from semcache.semantic.verified.decisions import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
    pooled_prior,
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
    by_source: dict[str, Outcome] = {}
    """A mixed stream's requests of each source, counted apart (``Stream.source``)."""

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
    tally = _Tally(stream)
    for i in range(len(stream.texts)):
        j = _nearest(sims, i, entries)
        if j is not None and score(i, j) >= threshold:
            tally.count(i, "hits")
            if stream.cluster[i] != stream.cluster[j]:
                tally.count(i, "wrong")
            continue
        entries.append(i)
    return tally.outcome(f"static {threshold:.3f}")


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
    tally = _Tally(stream)
    for i in range(len(stream.texts)):
        j = _nearest(sims, i, entries)
        if j is None or sims[i, j] < floor:
            entries.append(i)
            continue
        s = score(i, j)
        own = observations.get(j, [])
        if own:
            tally.count(i, "informed")
        decision = decide(
            s, own, _near_prior(sims, entries, j, observations, prior, params), params, rng.random()
        )
        correct = stream.cluster[i] == stream.cluster[j]
        if decision.action is Action.EXPLOIT:
            tally.count(i, "hits")
            if not correct:
                tally.count(i, "wrong")
            continue
        tally.count(i, "explores")
        kept, dropped = observed(own, Observation(similarity=s, correct=correct, at=float(i)))
        observations[j] = kept
        prior.add([kept[-1]])
        prior.remove(dropped)
        if not correct:
            entries.append(i)
    return tally.outcome(f"verified {params.max_error:.2f}")


def _near_prior(
    sims: np.ndarray,
    entries: list[int],
    j: int,
    observations: dict[int, list[Observation]],
    partition: PartitionPrior,
    params: VerifiedParams,
) -> PartitionPrior:
    """The prior ``PartitionIndex.decide`` uses: entry ``j``'s and its nearest entries'
    observations (``params.prior_neighbours`` of them), or the whole partition's."""
    k = params.prior_neighbours
    if not 0 < k < len(entries):
        return partition
    known = np.asarray(entries)
    near = {int(e) for e in known[np.argsort(-sims[j, known])[:k]]} | {j}
    return pooled_prior(observations.get(e, []) for e in near)


class _Tally:
    """Counts of a run, overall and per source of a mixed stream."""

    FIELDS = ("hits", "wrong", "explores", "informed")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.total = dict.fromkeys(self.FIELDS, 0)
        self.per_source: dict[str, dict[str, int]] = {
            name: dict.fromkeys(self.FIELDS, 0) for name in sorted(set(stream.source))
        }

    def count(self, i: int, field: str) -> None:
        self.total[field] += 1
        if self.stream.source:
            self.per_source[self.stream.source[i]][field] += 1

    def outcome(self, policy: str) -> Outcome:
        requests = Counter(self.stream.source)
        by_source = {
            name: _outcome(policy, requests[name], counts)
            for name, counts in self.per_source.items()
        }
        overall = _outcome(policy, len(self.stream.texts), self.total)
        return msgspec.structs.replace(overall, by_source=by_source)


def _outcome(policy: str, requests: int, counts: dict[str, int]) -> Outcome:
    return Outcome(
        policy=policy,
        requests=requests,
        hits=counts["hits"],
        wrong=counts["wrong"],
        explores=counts["explores"],
        informed=counts["informed"],
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
    outcomes: Sequence[Outcome],
    max_error: float,
    *,
    per_request: bool = False,
    every_source: bool = False,
) -> Outcome | None:
    """Of static runs on one stream, the one with the most hits whose realized error (among
    answers served, or with ``per_request`` among all requests) is at most max_error (tuned
    after the fact: the most favourable static setting); with ``every_source``, at most
    max_error on each source of a mixed stream as well."""
    best: Outcome | None = None
    for out in outcomes:
        held = [out, *out.by_source.values()] if every_source else [out]
        errors = [o.wrong_per_request if per_request else o.error_rate for o in held]
        if out.hits and max(errors) <= max_error and (best is None or out.hits > best.hits):
            best = out
    return best


def _nearest(sims: np.ndarray, i: int, entries: list[int]) -> int | None:
    if not entries:
        return None
    row = sims[i, entries]
    return entries[int(np.argmax(row))]
