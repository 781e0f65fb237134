"""The stream evaluation (semcache.tuning.stream_*) on a small hand-made stream."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from semcache.semantic.verified.decisions import VerifiedParams
from semcache.tuning.pairs import Pair
from semcache.tuning.stream_build import Stream, build_repeated_stream, build_stream, variant
from semcache.tuning.stream_eval import Comparison, compare
from semcache.tuning.stream_policies import (
    Outcome,
    best_static,
    ceiling,
    repeats,
    run_static,
    run_verified,
)
from semcache.tuning.stream_report import format_comparison, format_seeds

PAIRS = [
    Pair("a1", "a2", 1),
    Pair("a2", "a3", 1),  # a1, a2, a3: one cluster through a2
    Pair("a1", "b1", 0),  # b1: a hard negative, a cluster of its own
    Pair("c1", "c2", 1),
]


def test_clusters_are_the_components_of_the_duplicate_pairs() -> None:
    stream = build_stream(PAIRS, limit=None, seed=1)
    assert sorted(stream.texts) == ["a1", "a2", "a3", "b1", "c1", "c2"]
    cluster = dict(zip(stream.texts, stream.cluster, strict=True))
    assert cluster["a1"] == cluster["a2"] == cluster["a3"]
    assert len({cluster["a1"], cluster["b1"], cluster["c1"]}) == 3
    assert cluster["c1"] == cluster["c2"]
    assert build_stream(PAIRS, limit=None, seed=1) == stream  # seeded
    # A limit draws whole components (here the a/b one or the c one first).
    assert len(build_stream(PAIRS, limit=1, seed=1).texts) in (2, 4)


def test_static_and_verified_runs_count_hits_errors_and_explores() -> None:
    stream = build_stream(PAIRS, limit=None, seed=3)
    n = len(stream.texts)
    same = np.equal.outer(stream.cluster, stream.cluster)
    sims = np.where(same, 0.95, 0.9).astype(np.float32)  # b1 sits close to the a's

    def score(i: int, j: int) -> float:
        return float(sims[i, j])

    loose = run_static(stream, sims, score, 0.85)
    assert loose.requests == n and loose.hits > 0 and loose.wrong > 0
    strict = run_static(stream, sims, score, 0.93)
    assert strict.wrong == 0
    assert best_static([loose, strict], 0.05) == strict
    params = VerifiedParams(max_error=0.05, min_observations=100)
    verified = run_verified(stream, sims, score, params, floor=0.5, seed=0)
    assert verified.hits == 0  # too little evidence to serve: every candidate is explored
    assert verified.explores == n - 1


def test_a_repeated_stream_asks_popular_clusters_again_in_other_words() -> None:
    repeated = build_repeated_stream(PAIRS, requests=400, clusters=10, seed=2)
    stream = repeated.stream
    assert repeated.drawn == 400 and repeated.clusters == 3  # the a's, b1, the c's
    assert len(set(stream.texts)) == len(stream.texts)  # exact repeats are the exact cache's
    assert len(stream.texts) < 400
    originals = {p.text_a for p in PAIRS} | {p.text_b for p in PAIRS}
    source = {t: next(o for o in originals if o in t.casefold()) for t in stream.texts}
    index = {t: c for t, c in zip(stream.texts, stream.cluster, strict=True)}
    for text, origin in source.items():  # a variant keeps its question's cluster (a, b, c)
        for other, other_origin in source.items():
            assert (index[text] == index[other]) == (origin[0] == other_origin[0])
    asked = Counter(stream.cluster)
    assert len(asked) == 3 and max(asked.values()) > min(asked.values())  # Zipf-like
    assert build_repeated_stream(PAIRS, requests=400, clusters=10, seed=2) == repeated
    rng = random.Random(0)
    variants = {variant("Why is the sky blue?", rng) for _ in range(500)}
    assert len(variants) == 16 and "why is the sky blue" in variants


def test_the_ceiling_is_every_repeat_served_right_plus_the_wrong_answers_allowed() -> None:
    stream = Stream(texts=[f"q{i}" for i in range(8)], cluster=[0, 1, 0, 2, 0, 1, 3, 4])
    assert repeats(stream) == 3  # the second and third 0, the second 1
    assert ceiling(stream, 0.0) == 3
    assert ceiling(stream, 0.25) == 4  # 3 right and 1 wrong: a quarter of those served
    assert ceiling(stream, 0.25, per_request=True) == 5  # 3 right and 2 wrong: 2 of 8 asked
    assert ceiling(stream, 0.9, per_request=True) == 7  # never more than all but the first
    assert ceiling(Stream(texts=[], cluster=[]), 0.05) == 0


def test_the_comparison_reports_informed_decisions_and_the_ceiling() -> None:
    stream = build_stream(PAIRS, limit=None, seed=3)
    same = np.equal.outer(stream.cluster, stream.cluster)
    sims = np.where(same, 0.95, 0.9).astype(np.float32)
    vectors = np.linalg.cholesky(sims.astype(np.float64) + 1e-9 * np.eye(len(sims)))
    params = VerifiedParams(max_error=0.05, min_observations=1, prior_weight=0.0)
    rows = compare(stream, vectors, params, verifier=None, floor=0.5, seed=0, deltas=(0.05,))
    (row,) = rows
    assert row.ceiling == ceiling(stream, 0.05) == repeats(stream) == 3  # a2|a3, c2 after a1, c1
    verified = row.verified_cosine
    # An entry asked again after an explore has observations of its own.
    assert 0 < verified.informed <= verified.hits + verified.explores
    assert verified.wrong_per_request == verified.wrong / verified.requests
    text = format_comparison(rows)
    assert "wrong/req" in text and "informed" in text
    assert f"ceiling at 0.05: {row.ceiling} hits" in text
    assert row.ceiling_per_request == ceiling(stream, 0.05, per_request=True) == 3
    assert "with vCache's error rate" in text


def test_static_thresholds_are_tuned_for_either_error_rate() -> None:
    loose = Outcome(policy="static 0.8", requests=100, hits=40, wrong=4, explores=0)
    strict = Outcome(policy="static 0.9", requests=100, hits=20, wrong=0, explores=0)
    assert best_static([loose, strict], 0.05) == strict  # 4 of 40 served: 10 %
    assert best_static([loose, strict], 0.05, per_request=True) == loose  # 4 of 100 asked


def test_several_seeds_are_summed_up_a_line_per_max_error() -> None:
    def row(verified: tuple[int, int], static: tuple[int, int] | None) -> Comparison:
        def out(policy: str, hits: int, wrong: int) -> Outcome:
            return Outcome(policy=policy, requests=100, hits=hits, wrong=wrong, explores=0)

        return Comparison(
            max_error=0.05,
            verified_cosine=out("verified 0.05", *verified),
            verified_verifier=None,
            static_cosine=out("static 0.99", *static) if static else None,
            static_verifier=None,
        )

    text = format_seeds([(0, [row((2, 0), (1, 0))]), (1, [row((1, 0), None)])])
    assert text.splitlines()[1] == "     0.05  0: 2/0 vs 1/0 2.00x; 1: 1/0 vs none"
