"""A tiny random-weight sequence classifier (HF folder) that real vLLM serves at ``/classify``.

``LlamaForSequenceClassification`` over the tiny Llama's shape (2 layers, hidden 128) with
two labels (``id2label`` NEGATIVE / POSITIVE) and the tiny Llama's tokenizer (copied from its
folder, so nothing is trained here). vLLM serves it with ``--runner pooling``: last-token
pooling, softmax over the ``score`` head. The score head is set so the random weights still
give clearly different labels and probabilities per text. Seeds are fixed: the folder is the same on
every build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harness import tiny_llama as tiny_llama_module
from harness.tiny_llama import (
    TINY_SHAPE,
    _sentences,
    build_once,
    build_tiny_llama,
    recipe_of,
)

LABELS = ("NEGATIVE", "POSITIVE")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _build(dest: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    base = LlamaConfig.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=base.vocab_size,
        **TINY_SHAPE,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=False,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
        architectures=["LlamaForSequenceClassification"],
        dtype="bfloat16",
    )
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.copy_(_score_head(model, dest))
    model.bfloat16().save_pretrained(dest)


def _score_head(model: object, tokenizer_dir: Path) -> object:
    """A score head that splits English-like sentences about evenly between the two labels.

    A random head gives every text nearly the same logits (the last hidden states share a large
    common part): this one reads the main direction along which the states differ (orthogonal
    to their mean), so labels vary with the text and most probabilities are far from 0.5.
    """
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    states = []
    for text in _sentences(200, seed=7):
        ids = tokenizer(text, return_tensors="pt")
        states.append(model.model(**ids).last_hidden_state[0, -1].float())  # type: ignore[attr-defined]
    hidden = torch.stack(states)
    mean = hidden.mean(0)
    direction = torch.linalg.svd(hidden - mean, full_matrices=False).Vh[0]
    direction -= (direction @ mean) / (mean @ mean) * mean
    direction *= 1.5 / (direction @ (hidden - mean).T).std()  # logit gaps of ~±3
    return torch.stack([-direction, direction])


def build_tiny_classifier(dest: Path, tokenizer_dir: Path) -> Path:
    """Create the classifier folder at ``dest`` unless an up-to-date one is already there."""
    recipe = recipe_of(Path(__file__), Path(tiny_llama_module.__file__))
    return build_once(dest, recipe, lambda tmp: _build(tmp, tokenizer_dir))


def tiny_classifier(models_dir: Path) -> Path:
    """The tiny classifier under ``models_dir`` (the tiny Llama's tokenizer; both built once)."""
    tokenizer_dir = build_tiny_llama(models_dir / "tiny-llama")
    return build_tiny_classifier(models_dir / "tiny-classifier", tokenizer_dir)
