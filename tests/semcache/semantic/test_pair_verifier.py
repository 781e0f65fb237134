"""The shipped pair verifier: loads, is versioned by its weights, and decides sensibly."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import (
    DEFAULT_VERIFIER_DIR,
    WEIGHTS_FILE,
    PairVerifier,
    VerifierMismatch,
    lexical_features,
    load_verifier,
)


def test_version_is_stable_and_recorded(verifier: PairVerifier) -> None:
    again = load_verifier()
    assert again.version == verifier.version
    assert verifier.meta is not None and verifier.meta.version == verifier.version
    assert verifier.version.startswith("v-")


def test_trained_for_the_shipped_encoder(verifier: PairVerifier, encoder: Encoder) -> None:
    assert verifier.meta is not None
    assert verifier.meta.encoder_version == encoder.version
    assert verifier.recommended is not None


def test_changed_weights_change_the_version_and_fail_the_check(tmp_path: Path) -> None:
    copy = tmp_path / "verifier"
    shutil.copytree(DEFAULT_VERIFIER_DIR, copy)
    with np.load(copy / WEIGHTS_FILE) as archive:
        weights = {name: archive[name] for name in archive.files}
    original = PairVerifier(weights).version
    weights["b2"] = weights["b2"] + 0.5
    assert PairVerifier(weights).version != original
    np.savez_compressed(copy / WEIGHTS_FILE, **weights)
    with pytest.raises(VerifierMismatch):
        load_verifier(copy)


async def test_decisions_on_clear_pairs(verifier: PairVerifier, encoder: Encoder) -> None:
    a = [
        "How do I lose 10 kg in a month?",
        "What is the best way to learn Python?",
        "What is the capital of France?",
    ]
    b = [
        "How do I lose 30 kg in a month?",  # different number
        "What's the best way to learn Python?",  # same question
        "What is the population of France?",  # same topic, other question
    ]
    u, v = await encoder.encode(a), await encoder.encode(b)
    probs = verifier.probabilities(u, v, a, b)
    assert probs[1] > 0.5
    assert probs[1] > probs[0]
    assert probs[1] > probs[2]
    # Symmetric: which text is cached and which is new does not matter.
    np.testing.assert_allclose(verifier.probabilities(v, u, b, a), probs, atol=1e-5)


def test_lexical_features_see_numbers_negation_and_order() -> None:
    rows = lexical_features(
        ["lose 10 kg", "Why is it good?", "Import from India to Canada", "same words"],
        ["lose 30 kg", "Why isn't it good?", "Import from Canada to India", "same words"],
    )
    assert rows[0, 4] == 1.0  # numbers differ
    assert rows[1, 7] == 1.0  # negation on one side only
    assert rows[2, 10] > 0  # shared words in another order
    assert rows[3, 0] == 1.0 and rows[3, 10] == 0
