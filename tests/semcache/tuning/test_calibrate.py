"""`semcache calibrate`: precision / hit-rate curves on a small labelled file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends.local.classifier import load_classifier
from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import PairVerifier
from semcache.tuning.calibrate import (
    THRESHOLDS,
    calibrate,
    format_report,
)
from semcache.tuning.pairs import QQP_PAIRS, load_pairs, split_pairs


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 held-out QQP pairs (40 same, 40 different) written as a user would bring them."""
    test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    same = [p for p in test if p.label == 1][:40]
    different = [p for p in test if p.label == 0][:40]
    path = tmp_path_factory.mktemp("calibrate") / "pairs.jsonl"
    with path.open("w") as fh:
        for p in same + different:
            fh.write(json.dumps({"text_a": p.text_a, "text_b": p.text_b, "label": p.label}) + "\n")
    return path


async def test_chat_curve(pairs_file: Path, encoder: Encoder, verifier: PairVerifier) -> None:
    report = await calibrate(pairs_file, "chat", encoder=encoder, verifier=verifier)
    assert (report.pairs, report.servable) == (80, 40)
    assert [p.threshold for p in report.cosine] == list(THRESHOLDS)
    # Independently: the cosine of each pair from the encoder.
    pairs = load_pairs(pairs_file)
    a = await encoder.encode([p.text_a for p in pairs])
    b = await encoder.encode([p.text_b for p in pairs])
    cos = np.sum(a * b, axis=1)
    labels = np.array([p.label for p in pairs])
    for point in report.cosine:
        hits = cos >= point.threshold
        assert point.hits == int(hits.sum())
        assert point.correct == int((hits & (labels == 1)).sum())
        assert point.hit_rate == pytest.approx(hits.mean())
    rates = [p.hit_rate for p in report.cosine]
    assert rates == sorted(rates, reverse=True)
    for point in report.verified:
        assert point.min_prob is not None
        assert point.precision_lower >= report.target_precision
    text = format_report(report)
    assert "cosine" in text and "task chat: 80 pairs" in text


async def test_classification_agreement(pairs_file: Path, encoder: Encoder) -> None:
    classifier = load_classifier(encoder)
    report = await calibrate(pairs_file, "classification", encoder=encoder, classifier=classifier)
    pairs = load_pairs(pairs_file)
    top_a = [s[0][0] for s in await classifier.classify([p.text_a for p in pairs])]
    top_b = [s[0][0] for s in await classifier.classify([p.text_b for p in pairs])]
    assert report.servable == sum(x == y for x, y in zip(top_a, top_b, strict=True))
    assert report.verified == []


async def test_embeddings_fidelity(pairs_file: Path, encoder: Encoder, tmp_path: Path) -> None:
    pairs = load_pairs(pairs_file)
    rows = [{"text_a": p.text_a, "text_b": p.text_b} for p in pairs]
    rows += [{"text_a": p.text_a, "text_b": p.text_a} for p in pairs[:10]]  # exact repeats
    path = tmp_path / "embeddings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = await calibrate(path, "embeddings", encoder=encoder)
    assert report.pairs == 90
    assert report.servable >= 10
    top = report.cosine[-1]
    assert top.threshold == 0.99
    # Backend = the cache encoder: a hit at 0.99 is faithful by construction.
    assert top.hits >= 10 and top.precision == 1.0
    assert "fidelity equals the similarity" in report.note
