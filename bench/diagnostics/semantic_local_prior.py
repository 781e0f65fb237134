"""Verified caching on the mixed stream with the prior pooled from the matched entry's
nearest entries instead of its whole partition: does a prior local in entry space keep the
templated source under delta? (A design probe for issue 35, not the product's path.)

    .venv/bin/python -m bench.diagnostics.semantic_local_prior [--neighbours 0,32,128]

The stream is ``bench/semantic_mixed.py``'s (seed 0, 1500 requests per source over 200
clusters); the policy is ``semcache.tuning.stream_policies.run_verified``'s, with one
change: for ``--neighbours K > 0`` the prior of a request matched to entry ``j`` holds the
judged observations of the ``K`` entries nearest ``j`` (cosine between the entries), not
those of every entry. ``K = 0`` is the product's partition prior and reproduces the bench.
Prints, per delta, hits and wrong answers overall and per source.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import numpy as np

from backends.classifier import DEFAULT_EXAMPLES
from semcache.semantic.verified import (
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
)
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


def mixed_stream(seed: int) -> Stream:
    files = {"paraphrase": PARAPHRASE_PAIRS, "classify": DEFAULT_EXAMPLES}
    qqp_test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    pairs = {
        name: qqp_test if name == "qqp" else source_pairs(name, files, seed=seed, limit=600)
        for name in SOURCES
    }
    return stream_of_sources(pairs, seed=seed, limit=600, repeated=1500, clusters=200)


def run(
    stream: Stream, sims: np.ndarray, delta: float, neighbours: int, seed: int
) -> dict[str, tuple[int, int]]:
    """Hits and wrong answers per source of the verified policy at ``delta``."""
    params = VerifiedParams(max_error=delta)
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
        prior = partition
        if neighbours:
            known = np.asarray(entries)
            near = {int(e) for e in known[np.argsort(-sims[j, known])[:neighbours]]} | {j}
            prior = PartitionPrior()
            for e in near:  # the entry's own included: ``decide`` takes them out again
                prior.add(observations.get(e, []))
        decision = decide(s, own, prior, params, rng.random())
        correct = stream.cluster[i] == stream.cluster[j]
        if decision.action is Action.EXPLOIT:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--neighbours", default="0,32,128")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stream = mixed_stream(args.seed)
    encoder = load_encoder()
    try:
        embedded = embed_texts(encoder, sorted(set(stream.texts)), cache_dir=EMBEDDING_CACHE_DIR)
    finally:
        asyncio.run(encoder.aclose())
    vectors = embedded.of(stream.texts)
    sims = vectors @ vectors.T
    for k in (int(n) for n in args.neighbours.split(",")):
        for delta in DELTAS:
            served = run(stream, sims, delta, k, args.seed)
            hits = sum(h for h, _ in served.values())
            wrong = sum(w for _, w in served.values())
            cells = "  ".join(
                f"{name} {h}/{w} ({w / max(h, 1):.3f})" for name, (h, w) in served.items()
            )
            print(
                f"neighbours {k:>4}  delta {delta:.2f}: {hits} hits, {wrong} wrong "
                f"({wrong / max(hits, 1):.3f}) | {cells}",
                flush=True,
            )


if __name__ == "__main__":
    main()
