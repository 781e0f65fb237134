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
nearest entry by cosine. Error rate is the share of wrong answers among those served; the
share of wrong answers among all requests (vCache's error rate) is shown beside it.

Two figures say how far any policy could go on a stream, whatever its decision rule:

- the ceiling: every request whose cluster was asked before served right, plus as many wrong
  answers as ``max_error`` allows (``ceiling``); when twice the best static threshold's hits
  is above it, no policy meets a 2x target on that stream;
- informed: of the candidates the verified policy decided on, those whose entry had judged
  observations of its own. Only these can be told apart from what a score threshold would
  do: the rest are decided from the partition's observations at about the same score, which
  is a threshold learned online (the best static threshold is that threshold tuned knowing
  the labels).

``build_repeated_stream`` makes the workload vCache targets instead: questions asked again
and again. Requests draw a cluster by a Zipf-like popularity, one of its questions, and a
surface variant of it (case, final question mark, a short lead-in or thanks: users wording
the same question a little differently); a text already asked is the exact cache's job and
is left out of the stream.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from semcache.calibrate import wilson_lower
from semcache.semantic.encoder import Encoder
from semcache.semantic.pairs import Pair
from semcache.semantic.verified import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
)
from semcache.semantic.verifier import PairVerifier

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


def _shuffled_components(
    pairs: Sequence[Pair], rng: random.Random
) -> tuple[dict[str, str], dict[str, list[str]], list[str]]:
    """The duplicate clusters (text → root), the texts of each component of the pairs (any
    label) by root, and those roots in a seeded order."""
    everything = _components(pairs, lambda p: True)
    duplicates = _components(pairs, lambda p: p.label == 1)
    groups: dict[str, list[str]] = {}
    for text, root in everything.items():
        groups.setdefault(root, []).append(text)
    roots = sorted(groups)
    rng.shuffle(roots)
    return duplicates, groups, roots


def build_stream(pairs: Sequence[Pair], *, limit: int | None, seed: int) -> Stream:
    """The questions of the pairs in a seeded random order, with their clusters.

    With ``limit``, whole components of the pairs (any label) are drawn until ``limit``
    questions are reached, so duplicates and hard negatives stay together.
    """
    rng = random.Random(seed)
    duplicates, groups, roots = _shuffled_components(pairs, rng)
    texts: list[str] = []
    for root in roots:
        if limit is not None and len(texts) >= limit:
            break
        texts.extend(sorted(groups[root]))
    rng.shuffle(texts)
    ids: dict[str, int] = {}
    cluster = [ids.setdefault(duplicates.get(t, t), len(ids)) for t in texts]
    return Stream(texts=texts, cluster=cluster)


_CASES: tuple[Callable[[str], str], ...] = (lambda t: t, str.lower)
_ENDINGS: tuple[Callable[[str], str], ...] = (lambda t: t, lambda t: t.rstrip().rstrip("?"))
_WRAPS: tuple[Callable[[str], str], ...] = (
    lambda t: t,
    lambda t: f"Question: {t}",
    lambda t: f"{t} Thanks!",
    lambda t: f"Can you tell me: {t}",
)


def variant(text: str, rng: random.Random) -> str:
    """One seeded surface variant of a question (16 in all)."""
    case, ending, wrap = rng.choice(_CASES), rng.choice(_ENDINGS), rng.choice(_WRAPS)
    return wrap(ending(case(text.strip())))


class RepeatedStream(msgspec.Struct, kw_only=True):
    stream: Stream
    drawn: int
    """Requests drawn; those whose text was asked before (exact hits) are not in ``stream``."""
    clusters: int
    """Clusters the requests were drawn from."""


def build_repeated_stream(
    pairs: Sequence[Pair], *, requests: int, clusters: int, seed: int, zipf_s: float = 1.0
) -> RepeatedStream:
    """``requests`` draws from ``clusters`` duplicate clusters with popularity ``1 / rank **
    zipf_s`` (ranks in a seeded order), each a surface variant of one of the cluster's
    questions; exact repeats are dropped (see module docstring).

    Clusters are taken whole components of the pairs (any label) at a time, so hard
    negatives of a popular question are asked too.
    """
    rng = random.Random(seed)
    duplicates, groups, roots = _shuffled_components(pairs, rng)
    members: dict[str, list[str]] = {}
    for root in roots:
        if len(members) >= clusters:
            break
        for text in sorted(groups[root]):
            members.setdefault(duplicates.get(text, text), []).append(text)
    chosen = list(members)
    rng.shuffle(chosen)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(chosen))]
    ids = {root: i for i, root in enumerate(chosen)}
    texts: list[str] = []
    cluster: list[int] = []
    seen: set[str] = set()
    for root in rng.choices(chosen, weights=weights, k=requests):
        text = variant(rng.choice(members[root]), rng)
        if text in seen:
            continue
        seen.add(text)
        texts.append(text)
        cluster.append(ids[root])
    return RepeatedStream(
        stream=Stream(texts=texts, cluster=cluster), drawn=requests, clusters=len(chosen)
    )


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


DELTAS = (0.01, 0.02, 0.05, 0.10)
COSINE_THRESHOLDS = tuple(round(0.80 + 0.005 * i, 3) for i in range(41))
PROB_THRESHOLDS = tuple(round(0.50 + 0.01 * i, 2) for i in range(51))


class Comparison(msgspec.Struct, kw_only=True):
    """Verified caching beside the best static thresholds, for one max_error."""

    max_error: float
    verified_cosine: Outcome
    verified_verifier: Outcome | None
    static_cosine: Outcome | None
    static_verifier: Outcome | None
    ceiling: int = 0
    """``ceiling(stream, max_error)``: the most hits any policy could serve."""
    static_cosine_per_request: Outcome | None = None
    """The best static cosine threshold under vCache's error rate (wrong / requests)."""
    ceiling_per_request: int = 0
    """The ceiling under vCache's error rate."""

    @property
    def top_static(self) -> Outcome | None:
        """The static run (cosine, or cosine + verifier) with the most hits, if any meets."""
        statics = [o for o in (self.static_cosine, self.static_verifier) if o is not None]
        return max(statics, key=lambda o: o.hits, default=None)


def compare(
    stream: Stream,
    vectors: np.ndarray,
    params: VerifiedParams,
    *,
    verifier: PairVerifier | None,
    floor: float,
    seed: int,
    deltas: Sequence[float] = DELTAS,
) -> list[Comparison]:
    """Run every policy on one stream (``vectors``: the texts' unit vectors, in order)."""
    sims = vectors @ vectors.T
    memo: dict[tuple[int, int], float] = {}

    def cosine(i: int, j: int) -> float:
        return float(sims[i, j])

    def probability(i: int, j: int) -> float:
        assert verifier is not None
        if (i, j) not in memo:
            prob = verifier.probabilities(
                vectors[[i]], vectors[[j]], [stream.texts[i]], [stream.texts[j]]
            )
            memo[(i, j)] = float(prob[0])
        return memo[(i, j)]

    static_cos = [run_static(stream, sims, cosine, t) for t in COSINE_THRESHOLDS]
    static_ver: list[Outcome] = []
    shipped = verifier.recommended if verifier is not None else None
    if shipped is not None:
        gate = shipped.threshold

        def gated(i: int, j: int) -> float:
            return probability(i, j) if sims[i, j] >= gate else 0.0

        static_ver = [run_static(stream, sims, gated, t) for t in PROB_THRESHOLDS]
    rows = []
    for delta in deltas:
        p = msgspec.structs.replace(params, max_error=delta)
        rows.append(
            Comparison(
                max_error=delta,
                verified_cosine=run_verified(stream, sims, cosine, p, floor=floor, seed=seed),
                verified_verifier=(
                    run_verified(stream, sims, probability, p, floor=floor, seed=seed)
                    if verifier is not None
                    else None
                ),
                static_cosine=best_static(static_cos, delta),
                static_verifier=best_static(static_ver, delta),
                ceiling=ceiling(stream, delta),
                static_cosine_per_request=best_static(static_cos, delta, per_request=True),
                ceiling_per_request=ceiling(stream, delta, per_request=True),
            )
        )
    return rows


def format_comparison(rows: Sequence[Comparison]) -> str:
    lines = [
        f"{'policy':<34}{'max_error':>10}{'error':>8}{'error<=':>9}{'wrong/req':>10}"
        f"{'hit rate':>10}{'hits':>7}{'explores':>10}{'informed':>10}{'vs static':>11}"
    ]
    for row in rows:
        best = row.top_static.hits if row.top_static else 0
        for name, out in (
            ("verified (cosine)", row.verified_cosine),
            ("verified (verifier prob)", row.verified_verifier),
        ):
            if out is not None:
                ratio = f"{out.hits / best:>10.2f}x" if best else f"{'-':>11}"
                lines.append(_row(name, row.max_error, out, f"{out.informed:>10}") + ratio)
        for name, maybe in (
            ("best static cosine", row.static_cosine),
            ("best static cos+verifier", row.static_verifier),
        ):
            if maybe is None:
                lines.append(f"{name:<34}{row.max_error:>10.2f}   (no threshold meets it)")
            else:
                label = f"{name} ({maybe.policy.split()[-1]})"
                lines.append(_row(label, row.max_error, maybe, f"{'-':>10}"))
        if row.ceiling:
            lines.append(
                f"{'':<4}2x the best static: {2 * best} hits; ceiling at {row.max_error:.2f}: "
                f"{row.ceiling} hits ({_reach(2 * best, row.ceiling)})"
            )
        vcache = row.static_cosine_per_request
        if row.ceiling_per_request and vcache is not None:
            lines.append(
                f"{'':<4}with vCache's error rate (wrong/req <= {row.max_error:.2f}): best "
                f"static cosine ({vcache.policy.split()[-1]}) {vcache.hits} hits, 2x "
                f"{2 * vcache.hits}; ceiling {row.ceiling_per_request} hits "
                f"({_reach(2 * vcache.hits, row.ceiling_per_request)})"
            )
    lines.append(
        "error: wrong answers / answers served; error<=: its one-sided 95 % Wilson bound; "
        "wrong/req: wrong answers / requests (vCache's error rate); explores: requests judged "
        "(backend calls a static threshold would have served or missed alike); informed: "
        "decisions on an entry with judged observations of its own; ceiling: every repeat "
        "served right plus max_error wrong (of those served, or of all requests)"
    )
    return "\n".join(lines)


def format_seeds(runs: Sequence[tuple[int, Sequence[Comparison]]]) -> str:
    """One line per max_error over streams of several seeds: the verified mode's (cosine)
    hits/wrong and the best static threshold's hits in each, and their ratio."""
    lines = [f"{'max_error':>9}  seed: verified (cosine) hits/wrong vs best static hits/wrong"]
    for k, first in enumerate(runs[0][1] if runs else ()):
        cells = []
        for seed, rows in runs:
            row = rows[k]
            ver = row.verified_cosine
            best = row.top_static
            shown = f"{best.hits}/{best.wrong}" if best else "none"
            ratio = f" {ver.hits / best.hits:.2f}x" if best else ""
            cells.append(f"{seed}: {ver.hits}/{ver.wrong} vs {shown}{ratio}")
        lines.append(f"{first.max_error:>9.2f}  " + "; ".join(cells))
    return "\n".join(lines)


def _reach(target: int, most: int) -> str:
    return "out of reach for any policy" if target > most else "under it"


def _row(name: str, delta: float, out: Outcome, informed: str) -> str:
    return (
        f"{name:<34}{delta:>10.2f}{out.error_rate:>8.3f}{out.error_upper:>9.3f}"
        f"{out.wrong_per_request:>10.4f}{out.hit_rate:>10.3f}{out.hits:>7}{out.explores:>10}"
        f"{informed}"
    )


def compare_file(
    pairs: Path,
    params: VerifiedParams,
    *,
    encoder: Encoder,
    limit: int | None = None,
    seed: int = 0,
    floor: float = 0.7,
    use_verifier: bool = True,
    repeated: int = 0,
    clusters: int = 500,
) -> list[Comparison]:
    """``compare`` on a pairs file with ``encoder`` (and the verifier); blocking; closes
    the encoder.

    ``repeated``: that many requests of a repeated stream over ``clusters`` clusters
    (``build_repeated_stream``) instead of each question once."""
    from semcache.semantic.pairs import embed_texts, load_pairs
    from semcache.semantic.verifier import load_verifier

    loaded = load_pairs(pairs)
    stream = (
        build_repeated_stream(loaded, requests=repeated, clusters=clusters, seed=seed).stream
        if repeated
        else build_stream(loaded, limit=limit, seed=seed)
    )
    try:
        embedded = embed_texts(encoder, sorted(set(stream.texts)), cache_dir=None)
    finally:
        asyncio.run(encoder.aclose())
    verifier = load_verifier() if use_verifier else None
    return compare(
        stream, embedded.of(stream.texts), params, verifier=verifier, floor=floor, seed=seed
    )
