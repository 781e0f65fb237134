"""Calibrate the semantic matcher on labelled pairs of your own domain.

    semcache calibrate --pairs FILE.jsonl [--task chat|classification|embeddings]
                       [--target-precision 0.95] [--no-verifier] [--json]

Each line of FILE is ``{"text_a", "text_b", "label"}`` (label 1 = same meaning; optional
for classification and embeddings). Treat text_a as the cached text and text_b as the new
one: a "hit" is a pair the matcher would serve, a "correct" hit one whose served answer is
right for text_b:

- chat: the pair is labelled 1 (a hit on a label-0 pair serves a wrong answer);
- classification: the classifier's top label for text_a equals the one for text_b;
- embeddings: the cosine between the embeddings backend's vectors of both texts is at
  least 0.99 (the served vector stays faithful).

The report gives precision and hit rate per cosine threshold, for cosine alone and for
cosine plus the pair verifier, and suggests the policy setting with the highest hit rate
whose precision reaches the target (conservatively: the Wilson 90 % lower bound of the
precision must reach it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol

import msgspec
import numpy as np
from tqdm import tqdm

from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import PairVerifier, pair_features
from semcache.tuning.pairs import EmbeddedTexts, Pair, embed_texts, load_pairs, unique_texts

Task = Literal["chat", "classification", "embeddings"]
TASKS: tuple[Task, ...] = ("chat", "classification", "embeddings")

THRESHOLDS = tuple(round(0.50 + 0.01 * i, 2) for i in range(50))  # 0.50 .. 0.99
MIN_PROBS = tuple(round(0.50 + 0.005 * i, 3) for i in range(100))  # 0.500 .. 0.995
FIDELITY = 0.99
"""An embeddings hit is faithful when the served vector's cosine to the true one is >= this."""

LabelScores = list[tuple[str, float]]


class Classifier(Protocol):
    async def classify(self, texts: Sequence[str]) -> list[LabelScores]: ...


Embedder = Callable[[list[str]], Awaitable[np.ndarray]]
"""The embeddings backend's true vectors (default: the cache's own encoder)."""


class CurvePoint(msgspec.Struct, kw_only=True):
    threshold: float
    min_prob: float | None = None
    hits: int
    correct: int
    precision: float
    precision_lower: float
    """Wilson 90 % lower bound of the precision."""
    hit_rate: float
    """Hits over all pairs."""
    recall: float
    """Correct hits over all pairs that would be correct if served."""


class Suggestion(msgspec.Struct, kw_only=True):
    """Policy settings (``SemanticRule``) reaching the target precision on these pairs."""

    threshold: float
    verifier: bool
    verifier_min_prob: float | None
    precision: float
    hit_rate: float
    recall: float


class CalibrationReport(msgspec.Struct, kw_only=True):
    task: Task
    pairs: int
    servable: int
    """Pairs whose answer would be correct if served (label 1, same label, faithful)."""
    target_precision: float
    matcher: str
    cosine: list[CurvePoint]
    verified: list[CurvePoint]
    """Cosine plus verifier: per threshold, the best min_prob reaching the target (if any)."""
    suggestion: Suggestion | None
    note: str = ""


class PairScores(msgspec.Struct, kw_only=True):
    """What the curves are computed from, one value per pair."""

    cosine: list[float]
    verifier: list[float] | None
    correct: list[bool]


def wilson_lower(successes: int, n: int, z: float = 1.645) -> float:
    """Lower end of the Wilson score interval (z = 1.645: one-sided 95 %, two-sided 90 %)."""
    if n == 0:
        return 0.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float((centre - margin) / denominator)


def point(
    hits: np.ndarray, correct: np.ndarray, threshold: float, min_prob: float | None = None
) -> CurvePoint:
    n_hits = int(hits.sum())
    good = int((hits & correct).sum())
    servable = int(correct.sum())
    return CurvePoint(
        threshold=threshold,
        min_prob=min_prob,
        hits=n_hits,
        correct=good,
        precision=good / n_hits if n_hits else 1.0,
        precision_lower=wilson_lower(good, n_hits),
        hit_rate=n_hits / len(hits) if len(hits) else 0.0,
        recall=good / servable if servable else 0.0,
    )


def cosine_curve(cosine: np.ndarray, correct: np.ndarray) -> list[CurvePoint]:
    return [point(cosine >= t, correct, t) for t in THRESHOLDS]


def best_verified_point(
    cosine: np.ndarray,
    probs: np.ndarray,
    correct: np.ndarray,
    threshold: float,
    target_precision: float,
    min_hits: int = 20,
    *,
    lower_bound: bool = True,
) -> CurvePoint | None:
    """At one cosine threshold, the lowest min_prob whose precision reaches the target.

    With ``lower_bound`` the Wilson lower bound of the precision must reach it (for a
    user's small file); without, the measured precision on at least ``min_hits`` hits.
    """
    candidate = cosine >= threshold
    for min_prob in MIN_PROBS:
        hits = candidate & (probs >= min_prob)
        if int(hits.sum()) < min_hits:
            return None
        p = point(hits, correct, threshold, min_prob)
        if (p.precision_lower if lower_bound else p.precision) >= target_precision:
            return p
    return None


def suggest(
    cosine: list[CurvePoint], verified: list[CurvePoint], target_precision: float
) -> Suggestion | None:
    """The highest hit rate among points whose precision lower bound reaches the target."""
    options = [p for p in cosine + verified if p.precision_lower >= target_precision]
    if not options:
        return None
    best = max(options, key=lambda p: (p.hit_rate, p.min_prob is None, -p.threshold))
    return Suggestion(
        threshold=best.threshold,
        verifier=best.min_prob is not None,
        verifier_min_prob=best.min_prob,
        precision=best.precision,
        hit_rate=best.hit_rate,
        recall=best.recall,
    )


def report_from_scores(
    task: Task, scores: PairScores, target_precision: float, matcher: str, note: str = ""
) -> CalibrationReport:
    cos = np.asarray(scores.cosine, dtype=np.float32)
    correct = np.asarray(scores.correct, dtype=bool)
    curve = cosine_curve(cos, correct)
    verified: list[CurvePoint] = []
    if scores.verifier is not None:
        probs = np.asarray(scores.verifier, dtype=np.float32)
        for threshold in THRESHOLDS:
            found = best_verified_point(cos, probs, correct, threshold, target_precision)
            if found is not None:
                verified.append(found)
    return CalibrationReport(
        task=task,
        pairs=len(correct),
        servable=int(correct.sum()),
        target_precision=target_precision,
        matcher=matcher,
        cosine=curve,
        verified=verified,
        suggestion=suggest(curve, verified, target_precision),
        note=note,
    )


async def score_pairs(
    pairs: Sequence[Pair],
    task: Task,
    *,
    encoder: Encoder,
    verifier: PairVerifier | None = None,
    classifier: Classifier | None = None,
    embedder: Embedder | None = None,
    cache_dir: Path | None = None,
) -> PairScores:
    """Cosine, verifier probability and correctness of each pair for a task."""
    if not pairs:
        raise ValueError("no pairs")
    texts = unique_texts(pairs)
    embedded = await asyncio.to_thread(
        embed_texts, encoder, texts, cache_dir=cache_dir, show_progress=len(texts) > 2000
    )
    u, v = embedded.pair_vectors(pairs)
    cosine = np.sum(u * v, axis=1)
    probs: np.ndarray | None = None
    if verifier is not None:
        a_texts, b_texts = [p.text_a for p in pairs], [p.text_b for p in pairs]
        probs = verifier.probabilities_of_features(pair_features(u, v, a_texts, b_texts))
    correct = await _correctness(pairs, task, embedded, classifier, embedder, encoder)
    return PairScores(
        cosine=cosine.tolist(),
        verifier=probs.tolist() if probs is not None else None,
        correct=correct.tolist(),
    )


async def _correctness(
    pairs: Sequence[Pair],
    task: Task,
    embedded: EmbeddedTexts,
    classifier: Classifier | None,
    embedder: Embedder | None,
    encoder: Encoder | None = None,
) -> np.ndarray:
    if task == "chat":
        if any(p.label not in (0, 1) for p in pairs):
            raise ValueError("chat calibration needs a label (0 or 1) on every pair")
        return np.asarray([p.label == 1 for p in pairs], dtype=bool)
    if task == "classification":
        if classifier is None:
            raise ValueError("classification calibration needs a classifier")
        texts = embedded.texts
        labels: dict[str, str] = {}
        classify_vectors = getattr(classifier, "classify_vectors", None)
        if classify_vectors is not None and getattr(classifier, "encoder", None) is encoder:
            # A head over the cache's own encoder: reuse the vectors instead of encoding again.
            for text, scores in zip(texts, classify_vectors(embedded.vectors), strict=True):
                labels[text] = scores[0][0]
            return np.asarray([labels[p.text_a] == labels[p.text_b] for p in pairs], dtype=bool)
        chunks = range(0, len(texts), 1024)
        for start in tqdm(chunks, desc="classify", unit="chunk", disable=None, leave=False):
            chunk = texts[start : start + 1024]
            for text, scores in zip(chunk, await classifier.classify(chunk), strict=True):
                labels[text] = scores[0][0]
        return np.asarray([labels[p.text_a] == labels[p.text_b] for p in pairs], dtype=bool)
    if embedder is None:
        u, v = embedded.pair_vectors(pairs)
    else:
        u = _normalised(await embedder([p.text_a for p in pairs]))
        v = _normalised(await embedder([p.text_b for p in pairs]))
    return np.asarray(np.sum(u * v, axis=1) >= FIDELITY, dtype=bool)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    matrix = np.asarray(vectors, dtype=np.float32)
    return np.asarray(matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12))


async def calibrate(
    pairs: Path | str | Sequence[Pair],
    task: Task,
    *,
    encoder: Encoder,
    verifier: PairVerifier | None = None,
    classifier: Classifier | None = None,
    embedder: Embedder | None = None,
    target_precision: float = 0.95,
    cache_dir: Path | None = None,
) -> CalibrationReport:
    """The precision / hit-rate curves of the current matcher on labelled pairs."""
    loaded = load_pairs(pairs) if isinstance(pairs, str | Path) else list(pairs)
    scores = await score_pairs(
        loaded,
        task,
        encoder=encoder,
        verifier=verifier,
        classifier=classifier,
        embedder=embedder,
        cache_dir=cache_dir,
    )
    matcher = encoder.version + (f"+{verifier.version}" if verifier is not None else "")
    note = ""
    if task == "embeddings" and embedder is None:
        note = (
            "embeddings backend = the cache encoder: a served vector's fidelity equals "
            "the similarity, so only thresholds >= 0.99 are faithful"
        )
    return report_from_scores(task, scores, target_precision, matcher, note)


SHOWN_THRESHOLDS = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.99)


def format_report(report: CalibrationReport) -> str:
    """A compact text table of a report."""
    lines = [
        f"task {report.task}: {report.pairs} pairs, {report.servable} servable "
        f"(matcher {report.matcher})",
        f"{'matcher':<22}{'threshold':>10}{'min_prob':>10}{'precision':>11}"
        f"{'hit rate':>10}{'recall':>9}",
    ]
    for p in report.cosine:
        if p.threshold in SHOWN_THRESHOLDS:
            lines.append(_row("cosine", p))
    for p in report.verified:
        if p.threshold in SHOWN_THRESHOLDS:
            lines.append(_row("cosine+verifier", p))
    s = report.suggestion
    if s is None:
        lines.append(f"no setting reaches precision {report.target_precision} on these pairs")
    else:
        verifier = f", verifier_min_prob = {s.verifier_min_prob}" if s.verifier else ""
        lines.append(
            f"suggested for precision >= {report.target_precision}: threshold = {s.threshold}, "
            f"verifier = {str(s.verifier).lower()}{verifier} "
            f"(precision {s.precision:.3f}, hit rate {s.hit_rate:.3f}, recall {s.recall:.3f})"
        )
    if report.note:
        lines.append(f"note: {report.note}")
    return "\n".join(lines)


def _row(name: str, p: CurvePoint) -> str:
    min_prob = f"{p.min_prob:.3f}" if p.min_prob is not None else "-"
    return (
        f"{name:<22}{p.threshold:>10.2f}{min_prob:>10}{p.precision:>11.3f}"
        f"{p.hit_rate:>10.3f}{p.recall:>9.3f}"
    )


ClassifierFactory = Callable[[Encoder], Classifier]


def calibrate_file(
    pairs: Path,
    task: Task,
    *,
    encoder: Encoder,
    target_precision: float = 0.95,
    use_verifier: bool = True,
    classifier_factory: ClassifierFactory | None = None,
) -> CalibrationReport:
    """Calibrate ``encoder`` (and the verifier) on a pairs file (blocking); closes it.

    ``classifier_factory`` builds the classifier a ``classification`` calibration compares
    labels with, on the loaded encoder (``semcache calibrate`` passes the embedded one).
    """
    if task == "classification" and classifier_factory is None:
        raise ValueError("classification calibration needs a classifier")
    from semcache.semantic.pair_verifier import load_verifier

    verifier = load_verifier() if use_verifier else None

    async def run() -> CalibrationReport:
        classifier = None
        if task == "classification" and classifier_factory is not None:
            classifier = classifier_factory(encoder)
        try:
            return await calibrate(
                pairs,
                task,
                encoder=encoder,
                verifier=verifier,
                classifier=classifier,
                target_precision=target_precision,
            )
        finally:
            await encoder.aclose()

    return asyncio.run(run())
