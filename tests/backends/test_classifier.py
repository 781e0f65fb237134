"""The embedded sentiment classifier over the real MiniLM encoder."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import numpy as np
import pytest

from backends.local.classifier import (
    DEFAULT_EXAMPLES,
    DEFAULT_HEAD,
    LABELS,
    LinearHead,
    TextClassifier,
    load_classifier,
    load_examples,
    train_head,
)
from semcache.semantic.encoder import Encoder
from server.encoders import load_encoder

# Not in the training sentences (backends/local/data/sentiment/sentiment.jsonl).
CLEAR = [
    ("I absolutely adore this little cafe, the pastries are divine.", "POSITIVE"),
    ("The hotel staff went out of their way to help us, superb stay.", "POSITIVE"),
    ("What a brilliant, heartwarming film.", "POSITIVE"),
    ("My new running shoes are comfortable and look great.", "POSITIVE"),
    ("The package never arrived and nobody answers the phone.", "NEGATIVE"),
    ("This is the most boring lecture I have ever sat through.", "NEGATIVE"),
    ("The printer jams every single time, total garbage.", "NEGATIVE"),
    ("The soup was cold and the waiter was rude to us.", "NEGATIVE"),
]


@pytest.fixture(scope="module")
async def encoder() -> AsyncIterator[Encoder]:
    enc = load_encoder()
    yield enc
    await enc.aclose()


@pytest.fixture(scope="module")
def classifier(encoder: Encoder) -> TextClassifier:
    return load_classifier(encoder)


def test_clear_examples_are_not_training_sentences() -> None:
    trained = {example.text for example in load_examples(DEFAULT_EXAMPLES)}
    assert not trained & {text for text, _ in CLEAR}


async def test_clear_examples_get_the_right_label(classifier: TextClassifier) -> None:
    results = await classifier.classify([text for text, _ in CLEAR])
    assert [scores[0][0] for scores in results] == [label for _, label in CLEAR]
    for scores in results:
        assert scores[0][1] > 0.5


async def test_scores_are_sorted_and_sum_to_one(classifier: TextClassifier) -> None:
    (scores,) = await classifier.classify(["It was fine, I guess."])
    assert sorted(label for label, _ in scores) == sorted(LABELS)
    assert [s for _, s in scores] == sorted((s for _, s in scores), reverse=True)
    assert sum(s for _, s in scores) == pytest.approx(1.0, abs=1e-6)
    assert await classifier.classify([]) == []


async def test_uses_the_injected_encoder(encoder: Encoder, classifier: TextClassifier) -> None:
    assert classifier.encoder is encoder
    before = encoder.stats.texts
    await classifier.classify(["one", "two"])
    assert encoder.stats.texts == before + 2
    assert encoder.version in classifier.version


def test_shipped_head_matches_the_encoder(classifier: TextClassifier, encoder: Encoder) -> None:
    """The shipped head was trained for this encoder (no silent in-memory retrain)."""
    shipped = msgspec.json.decode(DEFAULT_HEAD.read_bytes(), type=LinearHead)
    assert shipped.encoder_version == encoder.version
    assert classifier.head.version == shipped.version
    assert classifier.head.version == classifier.head.digest()


def test_training_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    y = ["POSITIVE" if row[0] > 0 else "NEGATIVE" for row in x]
    first = train_head(x, y, encoder_version="e", steps=200)
    second = train_head(x, y, encoder_version="e", steps=200)
    assert first.version == second.version
