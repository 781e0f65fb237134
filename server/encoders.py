"""The semantic cache's encoder, built from a model the backends load.

The one place that joins ``backends.local.sentence_model`` (how a model is loaded) and
``semcache.semantic.encoder`` (how the cache encodes with it): the app factory, the CLI's
offline commands, bench and the tests all build their encoder here.
"""

from __future__ import annotations

from pathlib import Path

from backends.local.sentence_model import load_sentence_model
from semcache.semantic.encoder import Encoder, TextModel


def load_encoder(
    model_dir: Path | str | None = None,
    *,
    threads: int | None = None,
    device: str = "cpu",
    max_batch_texts: int = 256,
    runtime: str | None = None,
    graph_dir: Path | None = None,
) -> Encoder:
    """The cache's micro-batched encoder over all-MiniLM-L6-v2 (or ``model_dir``), offline.

    The options are ``backends.local.sentence_model.load_sentence_model``'s.
    """
    loaded = load_sentence_model(
        model_dir, threads=threads, device=device, runtime=runtime, graph_dir=graph_dir
    )
    model: TextModel = loaded.model
    return Encoder(
        model,
        dimensions=loaded.dimensions,
        version=f"st-{loaded.version}",
        max_batch_texts=max_batch_texts,
        runtime=loaded.runtime,
    )
