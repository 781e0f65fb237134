"""Verified caching on the mixed stream with a prior local in entry space (the matched
entry's nearest entries) beside or instead of the whole partition's: does it keep the
templated source under delta, and at what cost in hits? (A design probe for issue 35, not
the product's path.)

    .venv/bin/python -m bench.diagnostics.semantic_local_prior \\
        [--neighbours 0,32,128] [--mode local,veto,blend] [--strength 10,200d]

The stream is ``bench/semantic_mixed.py``'s (``--seed``, 0 by default; 1500 requests per
source over 200 clusters); the policy is ``semcache.tuning.stream_policies.run_verified``'s.
``K = 0`` (``--neighbours``) is the product's partition prior and reproduces the bench,
whatever the mode. For ``K > 0`` the "neighbourhood" of a request matched to entry ``j``
is ``j`` and the ``K`` entries nearest it (cosine between the entries), and ``--mode``
picks how its judged observations are used:

- ``local``: the prior holds the neighbourhood's observations only, not the partition's.
- ``veto``: the product's decision (partition prior), except that a request it would serve
  is explored when the neighbourhood holds at least ``min_observations`` observations near
  the request's score (the kernel's evidence plus the entry's own: what the product asks
  before serving) and the decision on the local prior alone would not serve (its posterior
  mean is below ``1 - max_error``): local evidence can only take hits away, and where it
  is thin the partition decides.
- ``blend``: the local prior with the rest of the partition as pseudo-observations: the
  observations outside the neighbourhood, scaled to weigh as ``--strength`` observations
  at most near the request's score, are added to the neighbourhood's (a Beta-like
  shrinkage of the local evidence toward the partition's); one run per strength, which
  is a number of observations or, ending in ``d``, a multiple of delta (``200d``: 2 at
  delta 0.01, 20 at 0.10: the smaller the error allowed, the less the rest of the
  partition vouches for a neighbourhood).

Prints, per mode, K and delta, hits and wrong answers overall and per source with the
error's one-sided 95 % Wilson upper bound; ``over`` marks a source whose error exceeds
delta, ``over<=`` one whose Wilson bound alone does.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence

import numpy as np

from backends.local.classifier import DEFAULT_EXAMPLES
from semcache.semantic.verified.decisions import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    correctness,
    decide,
    observed,
    posterior,
)
from semcache.tuning.calibrate import wilson_lower
from semcache.tuning.mixed import SOURCES, source_pairs, stream_of_sources
from semcache.tuning.pairs import (
    EMBEDDING_CACHE_DIR,
    PARAPHRASE_PAIRS,
    QQP_PAIRS,
    embed_texts,
    load_pairs,
    split_pairs,
)
from semcache.tuning.stream_build import Stream
from server.encoders import load_encoder

FLOOR = 0.7
DELTAS = (0.01, 0.02, 0.05, 0.10)
MODES = ("local", "veto", "blend")


def mixed_stream(seed: int) -> Stream:
    files = {"paraphrase": PARAPHRASE_PAIRS, "classify": DEFAULT_EXAMPLES}
    qqp_test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    pairs = {
        name: qqp_test if name == "qqp" else source_pairs(name, files, seed=seed, limit=600)
        for name in SOURCES
    }
    return stream_of_sources(pairs, seed=seed, limit=600, repeated=1500, clusters=200)


def neighbourhood(sims: np.ndarray, entries: Sequence[int], j: int, k: int) -> set[int]:
    """Entry ``j`` and the ``k`` entries nearest it."""
    known = np.asarray(entries)
    return {int(e) for e in known[np.argsort(-sims[j, known])[:k]]} | {j}


def pooled(near: set[int], observations: dict[int, list[Observation]]) -> PartitionPrior:
    """A prior holding the judged observations of the entries ``near`` (the matched entry's
    own included: ``decide`` takes them out again)."""
    prior = PartitionPrior()
    for e in near:
        prior.add(observations.get(e, []))
    return prior


def blended(
    local: PartitionPrior,
    partition: PartitionPrior,
    similarity: float,
    strength: float,
    bandwidth: float | None,
) -> PartitionPrior:
    """``local`` plus the rest of ``partition``, scaled to weigh as ``strength``
    observations at most within the prior's kernel around ``similarity``."""
    right = np.maximum(partition.right - local.right, 0.0)
    wrong = np.maximum(partition.wrong - local.wrong, 0.0)
    kernel = np.ones(len(right))
    if bandwidth is not None:
        centres = np.linspace(0.0, 1.0, len(right))  # PartitionPrior's bins
        kernel = np.exp(-0.5 * ((centres - similarity) / bandwidth) ** 2)
    outside = float((right + wrong) @ kernel)
    scale = min(1.0, strength / outside) if outside > 1e-9 else 0.0
    prior = PartitionPrior()
    prior.right = local.right + scale * right
    prior.wrong = local.wrong + scale * wrong
    return prior


def vetoed(
    similarity: float, own: Sequence[Observation], local: PartitionPrior, params: VerifiedParams
) -> bool:
    """Whether the neighbourhood knows enough about such scores and its prior alone would
    not serve the entry (``decide``'s test on the local prior)."""
    weights, evidence = posterior(
        similarity, own, local, params.prior_weight, params.prior_bandwidth
    )
    mean, _ = correctness(similarity, weights)
    known = evidence + len(own) >= params.min_observations
    return known and mean < 1.0 - params.max_error


def strength_at(spec: str, delta: float) -> float:
    """The blend's pseudo-count: ``spec`` observations, or ``spec`` (ending in ``d``)
    times delta."""
    return float(spec[:-1]) * delta if spec.endswith("d") else float(spec)


def run(
    stream: Stream,
    sims: np.ndarray,
    delta: float,
    neighbours: int,
    seed: int,
    mode: str = "local",
    strength: str = "10",
) -> dict[str, tuple[int, int]]:
    """Hits and wrong answers per source of the verified policy at ``delta``."""
    params = VerifiedParams(max_error=delta)
    m = strength_at(strength, delta)
    rng = random.Random(seed)
    entries: list[int] = []
    observations: dict[int, list[Observation]] = {}
    partition = PartitionPrior()
    served: dict[str, list[int]] = {name: [0, 0] for name in sorted(set(stream.source))}
    for i in range(len(stream.texts)):
        j = entries[int(np.argmax(sims[i, entries]))] if entries else None
        if j is None or sims[i, j] < FLOOR:
            entries.append(i)
            continue
        s = float(sims[i, j])
        own = observations.get(j, [])
        u = rng.random()
        if not neighbours:
            action = decide(s, own, partition, params, u).action
        elif mode == "veto":
            action = decide(s, own, partition, params, u).action
            if action is Action.EXPLOIT:
                local = pooled(neighbourhood(sims, entries, j, neighbours), observations)
                if vetoed(s, own, local, params):
                    action = Action.EXPLORE
        else:
            prior = pooled(neighbourhood(sims, entries, j, neighbours), observations)
            if mode == "blend":
                prior = blended(prior, partition, s, m, params.prior_bandwidth)
            action = decide(s, own, prior, params, u).action
        correct = stream.cluster[i] == stream.cluster[j]
        if action is Action.EXPLOIT:
            served[stream.source[i]][0] += 1
            served[stream.source[i]][1] += int(not correct)
            continue
        kept, dropped = observed(own, Observation(similarity=s, correct=correct, at=float(i)))
        observations[j] = kept
        partition.add([kept[-1]])
        partition.remove(dropped)
        if not correct:
            entries.append(i)
    return {name: (hits, wrong) for name, (hits, wrong) in served.items()}


def error_upper(hits: int, wrong: int) -> float:
    """Upper end of the error rate's one-sided 95 % Wilson interval (the bench's)."""
    return 1.0 - wilson_lower(hits - wrong, hits)


def report(label: str, delta: float, served: dict[str, tuple[int, int]]) -> str:
    hits = sum(h for h, _ in served.values())
    wrong = sum(w for _, w in served.values())
    cells = []
    for name, (h, w) in served.items():
        rate, upper = w / max(h, 1), error_upper(h, w)
        flag = " over" if rate > delta else " over<=" if upper > delta else ""
        cells.append(f"{name} {h}/{w} ({rate:.3f} <={upper:.3f}{flag})")
    return (
        f"{label}  delta {delta:.2f}: {hits} hits, {wrong} wrong "
        f"({wrong / max(hits, 1):.3f}) | " + "  ".join(cells)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--neighbours", default="0,32,128", help="K values (0: partition)")
    parser.add_argument("--mode", default="local", help=f"modes for K > 0, of {MODES}")
    parser.add_argument("--strength", default="10", help="blend: pseudo-counts, 200d: 200 delta")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    modes = args.mode.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown --mode {sorted(unknown)}")
    stream = mixed_stream(args.seed)
    encoder = load_encoder()
    try:
        embedded = embed_texts(encoder, sorted(set(stream.texts)), cache_dir=EMBEDDING_CACHE_DIR)
    finally:
        asyncio.run(encoder.aclose())
    vectors = embedded.of(stream.texts)
    sims = vectors @ vectors.T
    ks = [int(n) for n in args.neighbours.split(",")]
    strengths = args.strength.split(",")
    for spec in strengths:
        strength_at(spec, 0.0)  # a ValueError now, not after the first runs
    runs = [("partition", 0, "0")] if 0 in ks else []
    for mode in modes:
        for spec in strengths if mode == "blend" else ["0"]:
            runs += [(mode, k, spec) for k in ks if k]
    for mode, k, spec in runs:
        label = f"{mode} {spec}" if mode == "blend" else mode
        started = time.perf_counter()
        for delta in DELTAS:
            served = run(stream, sims, delta, k, args.seed, mode, spec)
            print(report(f"{label:>9} K {k:>4}", delta, served), flush=True)
        print(f"{label} K {k}: {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
