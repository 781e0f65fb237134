"""A stream evaluation of chat semantic caching on labelled pairs: verified vs static.

The pairs' questions become a request stream (``stream_build``); every policy is replayed
on it (``stream_policies``): the verified mode at each max_error beside the best static
thresholds, tuned after the fact knowing the labels. The score is the cosine of the
encoder's vectors, or the pair verifier's probability of the nearest entry by cosine.

Two figures say how far any policy could go on a stream, whatever its decision rule:

- the ceiling: every request whose cluster was asked before served right, plus as many wrong
  answers as ``max_error`` allows (``ceiling``); when twice the best static threshold's hits
  is above it, no policy meets a 2x target on that stream;
- informed: of the candidates the verified policy decided on, those whose entry had judged
  observations of its own. Only these can be told apart from what a score threshold would
  do: the rest are decided from the partition's observations at about the same score, which
  is a threshold learned online (the best static threshold is that threshold tuned knowing
  the labels).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import PairVerifier
from semcache.semantic.verified.decisions import VerifiedParams
from semcache.tuning.stream_build import (
    Stream,
    build_repeated_stream,
    build_stream,
    source_stream,
)
from semcache.tuning.stream_policies import (
    Outcome,
    best_static,
    ceiling,
    run_static,
    run_verified,
)

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
    static_cosine_every_source: Outcome | None = None
    """A mixed stream: the best static cosine threshold that holds max_error on every source
    (``static_cosine`` holds it overall only)."""
    ceiling_by_source: dict[str, int] = {}
    """A mixed stream: the ceiling of each source's requests."""

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
                static_cosine_every_source=(
                    best_static(static_cos, delta, every_source=True) if stream.source else None
                ),
                ceiling_by_source={
                    name: ceiling(source_stream(stream, name), delta)
                    for name in sorted(set(stream.source))
                },
            )
        )
    return rows


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
    from semcache.tuning.pairs import load_pairs

    loaded = load_pairs(pairs)
    stream = (
        build_repeated_stream(loaded, requests=repeated, clusters=clusters, seed=seed).stream
        if repeated
        else build_stream(loaded, limit=limit, seed=seed)
    )
    return compare_stream(
        stream, params, encoder=encoder, seed=seed, floor=floor, use_verifier=use_verifier
    )


def compare_stream(
    stream: Stream,
    params: VerifiedParams,
    *,
    encoder: Encoder,
    seed: int = 0,
    floor: float = 0.7,
    use_verifier: bool = True,
    cache_dir: Path | None = None,
) -> list[Comparison]:
    """``compare`` on a built stream with ``encoder`` (and the verifier); blocking; closes
    the encoder. ``cache_dir``: keep the texts' vectors there (``embed_texts``)."""
    from semcache.semantic.pair_verifier import load_verifier
    from semcache.tuning.pairs import embed_texts

    try:
        embedded = embed_texts(encoder, sorted(set(stream.texts)), cache_dir=cache_dir)
    finally:
        asyncio.run(encoder.aclose())
    verifier = load_verifier() if use_verifier else None
    return compare(
        stream, embedded.of(stream.texts), params, verifier=verifier, floor=floor, seed=seed
    )
