"""Semantic-cache quality on the shipped data: is a semantic hit the right answer?

    .venv/bin/python -m bench.semantic_quality

- chat (same-meaning decision): QQP pairs of the held-out test split (questions never seen
  by the verifier's training or its threshold choice): precision / recall of cosine alone
  and of cosine + verifier, and the shipped setting (chosen on the validation split);
- classification: label agreement (served labels == the classifier's labels for the new
  text) and hit rate, threshold chosen on the validation split, reported on test and on
  the paraphrase pairs;
- embeddings: fidelity (cosine between the served vector and the backend's true vector for
  the new text) at several thresholds on the paraphrase pairs and QQP test texts;
- the verifier's cost per lookup;
- with ``--stream``: only the stream evaluation of chat (``semcache.tuning.stream_eval``):
  verified caching at several max_error values beside the best static thresholds; with
  ``--repeated N`` as well, on N requests whose questions repeat (Zipf-like popularity over
  ``--clusters`` duplicate clusters, surface variants of their questions).

Uses the same code as ``semcache calibrate``; embeddings are cached under .data/embeddings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time

import numpy as np

from backends.local.classifier import TextClassifier, load_classifier
from semcache.semantic.encoder import Encoder
from semcache.semantic.items import label_margin
from semcache.semantic.pair_verifier import PairVerifier, load_verifier, pair_features
from semcache.semantic.verified.decisions import VerifiedParams
from semcache.tuning.calibrate import (
    FIDELITY,
    PairScores,
    point,
    report_from_scores,
    score_pairs,
)
from semcache.tuning.pairs import (
    EMBEDDING_CACHE_DIR,
    PARAPHRASE_PAIRS,
    QQP_PAIRS,
    Pair,
    Split,
    embed_texts,
    load_pairs,
    split_pairs,
    unique_texts,
)
from semcache.tuning.stream_build import Stream, build_repeated_stream, build_stream
from semcache.tuning.stream_eval import Comparison, compare
from semcache.tuning.stream_report import format_comparison, format_seeds
from server.encoders import load_encoder

HEADER = (
    f"{'matcher':<28}{'threshold':>10}{'min_prob':>10}{'precision':>11}{'recall':>9}{'hits':>7}"
)


def row(name: str, threshold: float, min_prob: float | None, scores: PairScores) -> str:
    cos = np.asarray(scores.cosine)
    correct = np.asarray(scores.correct, dtype=bool)
    hits = cos >= threshold
    if min_prob is not None:
        assert scores.verifier is not None
        hits &= np.asarray(scores.verifier) >= min_prob
    p = point(hits, correct, threshold, min_prob)
    shown = f"{min_prob:.3f}" if min_prob is not None else "-"
    return f"{name:<28}{threshold:>10.2f}{shown:>10}{p.precision:>11.3f}{p.recall:>9.3f}{p.hits:>7}"


async def chat_section(
    encoder: Encoder,
    verifier: PairVerifier,
    parts: dict[Split, list[Pair]],
    list_disagreements: bool = False,
) -> None:
    scores = await score_pairs(
        parts["test"], "chat", encoder=encoder, verifier=verifier, cache_dir=EMBEDDING_CACHE_DIR
    )
    positives = sum(scores.correct)
    print(f"\n== chat: QQP held-out test split, {len(parts['test'])} pairs, {positives} same ==")
    print(HEADER)
    for threshold in (0.80, 0.85, 0.90, 0.95, 0.99):
        print(row("cosine alone", threshold, None, scores))
    shipped = verifier.recommended
    assert shipped is not None
    for min_prob in (0.5, 0.8, 0.9):
        print(row("cosine+verifier", shipped.threshold, min_prob, scores))
    print(row("cosine+verifier (shipped)", shipped.threshold, shipped.min_prob, scores))
    print(
        f"shipped chat setting (chosen on the validation split): threshold {shipped.threshold},"
        f" verifier_min_prob {shipped.min_prob}"
    )
    label_ceiling(parts)
    if list_disagreements:
        disagreements(parts["test"], scores, shipped.threshold)


SPELLING_ONLY = re.compile(r"[\s?.!,;:'\"]+")


def label_ceiling(parts: dict[Split, list[Pair]]) -> None:
    """How often the labels call two spellings of one question different.

    A pair whose texts differ only in case, spacing and ``?.!,;:'"`` is the same question,
    so every such pair labelled 0 is label noise that caps any matcher's measured precision.
    """
    print("\nlabel noise: pairs identical but for case, spacing and punctuation")
    print(f"{'pairs':<10}{'identical':>10}{'labelled 0':>12}{'precision of serving them':>27}")
    everything = [p for part in parts.values() for p in part]
    for name, pairs in (("all", everything), ("test", parts["test"])):
        same = [
            p
            for p in pairs
            if SPELLING_ONLY.sub("", p.text_a.lower()) == SPELLING_ONLY.sub("", p.text_b.lower())
        ]
        noise = sum(p.label == 0 for p in same)
        share = 1 - noise / len(same) if same else float("nan")
        print(f"{name:<10}{len(same):>10}{noise:>12}{share:>27.3f}")


def disagreements(pairs: list[Pair], scores: PairScores, threshold: float) -> None:
    """The pairs labelled "different" among the verifier's best-scored 10 % of true matches.

    This is where the chat target (precision >= 0.95 at recall >= 0.10) is decided: every
    line printed counts as a wrong answer served. Printed for a reader to judge the labels.
    """
    assert scores.verifier is not None
    cos, prob = np.asarray(scores.cosine), np.asarray(scores.verifier)
    correct = np.asarray(scores.correct, dtype=bool)
    order = np.argsort(-np.where(cos >= threshold, prob, -1.0), kind="stable")
    needed = int(np.ceil(0.10 * correct.sum()))
    top = order[: int(np.searchsorted(np.cumsum(correct[order]), needed)) + 1]
    wrong = [i for i in top if not correct[i]]
    print(
        f"\nthe verifier's {len(top)} best-scored test pairs (recall 0.10, cosine >= "
        f"{threshold}): precision {correct[top].mean():.3f}; the {len(wrong)} labelled different:"
    )
    for i in wrong:
        print(f"  p={prob[i]:.3f} cos={cos[i]:.3f} | {pairs[i].text_a} || {pairs[i].text_b}")


async def classification_section(
    encoder: Encoder, parts: dict[Split, list[Pair]], paraphrases: list[Pair]
) -> None:
    classifier = load_classifier(encoder)

    async def scores_of(pairs: list[Pair]) -> PairScores:
        return await score_pairs(
            pairs,
            "classification",
            encoder=encoder,
            classifier=classifier,
            cache_dir=EMBEDDING_CACHE_DIR,
        )

    val = report_from_scores("classification", await scores_of(parts["val"]), 0.99, encoder.version)
    chosen = val.suggestion.threshold if val.suggestion is not None else 0.99
    print(f"\n== classification: label agreement ({classifier.version}) ==")
    print(f"threshold chosen on the QQP validation split for agreement >= 0.99: {chosen}")
    print(f"{'pairs':<28}{'threshold':>10}{'agreement':>11}{'hit rate':>10}{'hits':>7}")
    for name, pairs in (("QQP test", parts["test"]), ("paraphrase", paraphrases)):
        scores = await scores_of(pairs)
        cos = np.asarray(scores.cosine)
        correct = np.asarray(scores.correct, dtype=bool)
        for threshold in sorted({0.85, 0.90, 0.95, chosen}):
            p = point(cos >= threshold, correct, threshold)
            mark = " (chosen)" if threshold == chosen else ""
            print(
                f"{name + mark:<28}{threshold:>10.2f}{p.precision:>11.3f}"
                f"{p.hit_rate:>10.3f}{p.hits:>7}"
            )
    # The policy's min_label_margin: serve only cached labels clear of the boundary.
    rule = (await scores_of(parts["val"]), margins_of(classifier, parts["val"], encoder))
    print(
        "\nwith min_label_margin (the cached text's top-label log-odds margin), the smallest"
        " margin reaching agreement >= 0.99 on the validation split:"
    )
    print(
        f"{'pairs':<28}{'threshold':>10}{'margin':>8}{'agreement':>11}{'hit rate':>10}{'hits':>7}"
    )
    for threshold in (0.85, 0.90, 0.95):
        margin = smallest_margin(rule[0], rule[1], threshold)
        if margin is None:
            print(f"{'(none on val)':<28}{threshold:>10.2f}")
            continue
        for name, pairs in (("QQP test", parts["test"]), ("paraphrase", paraphrases)):
            scores = await scores_of(pairs)
            hits = (np.asarray(scores.cosine) >= threshold) & (
                margins_of(classifier, pairs, encoder) >= margin
            )
            p = point(hits, np.asarray(scores.correct, dtype=bool), threshold)
            print(
                f"{name:<28}{threshold:>10.2f}{margin:>8.2f}{p.precision:>11.3f}"
                f"{p.hit_rate:>10.3f}{p.hits:>7}"
            )


def margins_of(classifier: TextClassifier, pairs: list[Pair], encoder: Encoder) -> np.ndarray:
    """The label margin of each pair's cached text (text_a), as the gateway computes it."""
    embedded = embed_texts(encoder, unique_texts(pairs), cache_dir=EMBEDDING_CACHE_DIR)
    scores = classifier.classify_vectors(embedded.of([p.text_a for p in pairs]))
    return np.asarray([label_margin([prob for _, prob in row]) for row in scores])


def smallest_margin(scores: PairScores, margins: np.ndarray, threshold: float) -> float | None:
    cos = np.asarray(scores.cosine)
    correct = np.asarray(scores.correct, dtype=bool)
    for margin in np.arange(0.0, 10.0, 0.05):
        hits = (cos >= threshold) & (margins >= margin)
        if hits.sum() >= 20 and correct[hits].mean() >= 0.99:
            return float(round(margin, 2))
    return None


async def embeddings_section(
    encoder: Encoder, parts: dict[Split, list[Pair]], paraphrases: list[Pair]
) -> None:
    print("\n== embeddings: fidelity of the served vector ==")
    print(
        "backend = all-MiniLM-L6-v2 in the gateway, the same model as the cache encoder: "
        "the fidelity of a hit equals its similarity"
    )
    print(
        f"{'pairs':<16}{'threshold':>10}{'hit rate':>10}{'hits':>7}{'min fidelity':>14}"
        f"{'mean':>8}{f'share >= {FIDELITY}':>15}"
    )
    for name, pairs in (("paraphrase", paraphrases), ("QQP test", parts["test"])):
        scores = await score_pairs(
            pairs, "embeddings", encoder=encoder, cache_dir=EMBEDDING_CACHE_DIR
        )
        cos = np.asarray(scores.cosine)
        for threshold in (0.90, 0.95, 0.98, 0.99):
            hits = cos >= threshold
            fidelity = cos[hits]  # served = cached text's vector, true = new text's vector
            if len(fidelity):
                stats = (
                    f"{fidelity.min():>14.4f}{fidelity.mean():>8.4f}"
                    f"{(fidelity >= FIDELITY).mean():>15.3f}"
                )
            else:
                stats = f"{'-':>14}{'-':>8}{'-':>15}"
            print(f"{name:<16}{threshold:>10.2f}{hits.mean():>10.3f}{int(hits.sum()):>7}{stats}")


def verifier_cost(verifier: PairVerifier, candidates: int = 4, rounds: int = 2000) -> None:
    rng = np.random.default_rng(0)
    u = rng.standard_normal((candidates, 384)).astype(np.float32)
    v = rng.standard_normal((candidates, 384)).astype(np.float32)
    a = ["How do I lose 10 kg in a month?"] * candidates
    b = [f"How can I lose {n} kg in one month?" for n in range(candidates)]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        verifier.probabilities(u, v, a, b)
        times.append(time.perf_counter() - start)
    times.sort()
    features = pair_features(u, v, a, b)
    print(
        f"\n== verifier cost: {candidates} candidates per lookup ({features.shape[1]} features, "
        f"hidden {verifier.weights['w1'].shape[1]}) =="
    )
    print(
        f"p50 {times[len(times) // 2] * 1e6:.0f} us, p99 {times[int(len(times) * 0.99)] * 1e6:.0f}"
        " us per lookup (numpy, one thread), plus reading the candidates' vectors from FAISS"
    )


def stream_section(
    encoder: Encoder,
    verifier: PairVerifier,
    pairs: list[Pair],
    *,
    split: str,
    limit: int,
    seed: int,
    params: VerifiedParams,
    floor: float,
    repeated: int = 0,
    clusters: int = 500,
    zipf_s: float = 1.0,
) -> list[Comparison]:
    stream: Stream
    if repeated:
        drawn = build_repeated_stream(
            pairs, requests=repeated, clusters=clusters, seed=seed, zipf_s=zipf_s
        )
        stream = drawn.stream
        what = (
            f"{drawn.drawn} requests drawn from {drawn.clusters} clusters (Zipf s={zipf_s}), "
            f"{len(stream.texts)} after leaving exact repeats to the exact cache, asked of "
            f"{len(set(stream.cluster))} clusters"
        )
    else:
        stream = build_stream(pairs, limit=limit, seed=seed)
        what = f"{len(stream.texts)} questions in {len(set(stream.cluster))} clusters"
    embedded = embed_texts(encoder, sorted(set(stream.texts)), cache_dir=EMBEDDING_CACHE_DIR)
    print(
        f"\n== chat stream: QQP {split} split, {what} "
        f"(seed {seed}); verified: candidate floor {floor}, min_observations "
        f"{params.min_observations}, prior_weight {params.prior_weight}, prior_bandwidth "
        f"{params.prior_bandwidth}, audit_rate {params.audit_rate} =="
    )
    rows = compare(
        stream,
        embedded.of(stream.texts),
        params,
        verifier=verifier,
        floor=floor,
        seed=seed,
    )
    print(format_comparison(rows))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 on a busy shared machine)"
    )
    parser.add_argument(
        "--list-disagreements",
        action="store_true",
        help="print the test pairs labelled different among the verifier's best-scored "
        "10 %% of matches (the wrong answers that decide the chat target)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="only the chat stream evaluation: verified caching vs static thresholds",
    )
    parser.add_argument("--split", choices=("val", "test"), default="test")
    parser.add_argument("--limit", type=int, default=3000, help="questions in the stream")
    parser.add_argument(
        "--repeated",
        type=int,
        default=0,
        help="--stream on this many requests whose questions repeat (0: each asked once)",
    )
    parser.add_argument("--clusters", type=int, default=500, help="--repeated: clusters asked")
    parser.add_argument("--zipf", type=float, default=1.0, help="--repeated: popularity skew")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=1, help="--stream: this many streams, seeds --seed and up"
    )
    parser.add_argument("--floor", type=float, default=0.7, help="verified: candidate floor")
    parser.add_argument("--min-observations", type=int, default=10)
    parser.add_argument("--prior-weight", type=float, default=20.0)
    parser.add_argument("--audit-rate", type=float, default=0.02)
    parser.add_argument(
        "--prior-bandwidth", type=float, default=0.01, help="0: the prior weighs all alike"
    )
    args = parser.parse_args()
    started = time.time()
    encoder = load_encoder(threads=args.threads)
    verifier = load_verifier()
    parts = split_pairs(load_pairs(QQP_PAIRS))
    if args.stream:
        params = VerifiedParams(
            max_error=0.05,
            min_observations=args.min_observations,
            prior_weight=args.prior_weight,
            prior_bandwidth=args.prior_bandwidth or None,
            audit_rate=args.audit_rate,
        )
        try:
            runs = [
                (
                    seed,
                    stream_section(
                        encoder,
                        verifier,
                        parts[args.split],
                        split=args.split,
                        limit=args.limit,
                        seed=seed,
                        params=params,
                        floor=args.floor,
                        repeated=args.repeated,
                        clusters=args.clusters,
                        zipf_s=args.zipf,
                    ),
                )
                for seed in range(args.seed, args.seed + args.seeds)
            ]
            if len(runs) > 1:
                print(f"\n== {len(runs)} streams ==\n{format_seeds(runs)}")
        finally:
            await encoder.aclose()
        print(f"\n({time.time() - started:.0f} s; load average {os.getloadavg()[0]:.1f})")
        return
    paraphrases = load_pairs(PARAPHRASE_PAIRS)
    print(
        f"encoder {encoder.version}, verifier {verifier.version}; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    try:
        await chat_section(encoder, verifier, parts, args.list_disagreements)
        await classification_section(encoder, parts, paraphrases)
        await embeddings_section(encoder, parts, paraphrases)
        verifier_cost(verifier)
    finally:
        await encoder.aclose()
    print(f"\n({time.time() - started:.0f} s; load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    asyncio.run(main())
