"""A tiny random-weight cross-encoder (HF folder) that real vLLM serves at ``/score`` and
``/rerank``, for tests.

``LlamaForSequenceClassification`` over the tiny Llama's shape with one label (vLLM's
pooling runner scores a pair with a one-label classifier: query and document joined by the
tokenizer's pair template), and the tiny Llama's tokenizer. The score head reads the main
direction along which the last hidden states of pairs differ, so scores vary with the
document. Seeds are fixed: the folder is the same on every build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harness import tiny_llama as tiny_llama_module
from harness.tiny_classifier import TOKENIZER_FILES
from harness.tiny_llama import TINY_SHAPE, _sentences, build_once, build_tiny_llama, recipe_of

SERVED = "tiny-reranker"


def _build(dest: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

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
        num_labels=1,
        architectures=["LlamaForSequenceClassification"],
        dtype="bfloat16",
    )
    torch.manual_seed(2)
    model = LlamaForSequenceClassification(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sentences = list(_sentences(80, seed=11))
    states = []
    with torch.no_grad():
        for query, doc in zip(sentences[::2], sentences[1::2], strict=True):
            ids = tokenizer(query, doc, return_tensors="pt")
            states.append(model.model(**ids).last_hidden_state[0, -1].float())
        hidden = torch.stack(states)
        mean = hidden.mean(0)
        direction = torch.linalg.svd(hidden - mean, full_matrices=False).Vh[0]
        direction -= (direction @ mean) / (mean @ mean) * mean
        direction *= 1.5 / (direction @ (hidden - mean).T).std()
        model.score.weight.copy_(direction[None, :])
    model.bfloat16().save_pretrained(dest)


def tiny_cross_encoder(models_dir: Path) -> Path:
    """The tiny cross-encoder under ``models_dir`` (the tiny Llama's tokenizer; built once)."""
    tokenizer_dir = build_tiny_llama(models_dir / "tiny-llama")
    recipe = recipe_of(Path(__file__), Path(tiny_llama_module.__file__))
    dest = models_dir / SERVED
    return build_once(dest, recipe, lambda tmp: _build(tmp, tokenizer_dir))
