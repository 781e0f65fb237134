"""In-process embedding backend: a sentence-transformers model run in a worker thread."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from backends.interfaces import Embeddings
from backends.local.onnx_model import (
    load_checked_graph,
    onnx_or_torch,
    physical_cores,
    requested_runtime,
)
from backends.models import model_version

log = logging.getLogger(__name__)


class LocalEmbeddingBackend:
    """Encodes texts with a local sentence-transformers model (one encode at a time).

    ``runtime`` runs the forward pass in ``torch``, in ``onnx`` (ONNX Runtime: the same
    vectors to float rounding, faster on a CPU; see ``backends.local.onnx_model``), or
    ``auto`` (the default, or ``SEMCACHE_ENCODER_RUNTIME``): ONNX when a ``graph_dir`` is
    given and the graph reproduces torch's vectors, else torch. ``graph_dir`` holds the
    exported graphs, one folder per model version (the gateway passes
    ``<data_dir>/encoders``, shared with the semantic cache's encoder). Without one,
    ``auto`` means torch and ``onnx`` exports into a temporary folder that ``aclose``
    removes. A graph checked at an earlier start loads without torch
    (``backends.local.onnx_model.load_checked_graph``). ``threads``: ONNX Runtime's intra-op
    threads (default: the physical cores, what the torch model would use). Tokenizer, token
    counts and ``normalize`` are the same in either runtime.
    """

    def __init__(
        self,
        name: str,
        model_dir: Path,
        *,
        normalize: bool = True,
        batch_size: int = 64,
        runtime: str | None = None,
        graph_dir: Path | None = None,
        threads: int | None = None,
    ) -> None:
        self.name = name
        self.model_dir = model_dir
        self.normalize = normalize
        self.batch_size = batch_size
        self.requested_runtime = requested_runtime(runtime)
        self.runtime: str | None = None
        """What runs the forward pass once started: ``torch`` or ``onnx``."""
        self.graph_dir = graph_dir
        self.threads = threads
        self.dimensions = 0
        self._model: Any = None
        self._temp_graphs: Path | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        wanted = self.requested_runtime
        onnx = wanted == "onnx" or (wanted == "auto" and self.graph_dir is not None)
        version = model_version(self.model_dir) if onnx else ""
        if onnx and self.graph_dir is not None:
            twin = load_checked_graph(
                self.model_dir,
                self.graph_dir / version,
                threads=self.threads or physical_cores(),
                batch_size=self.batch_size,
            )
            if twin is not None:  # checked before: torch is not needed
                self.dimensions = twin.dimensions
                self.runtime = "onnx"
                log.info("embeddings backend %s runs on onnx (a checked graph)", self.name)
                return twin
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self.model_dir), device="cpu")
        self.dimensions = int(model.get_embedding_dimension() or 0)
        loaded: Any = model
        why: str | None = None
        if onnx:
            loaded, why = onnx_or_torch(
                model,
                self._graph_root() / version,
                required=wanted == "onnx",
                threads=self.threads or physical_cores(),
                batch_size=self.batch_size,
            )
        self.runtime = "torch" if loaded is model else "onnx"
        note = f" (ONNX Runtime unusable: {why})" if why else ""
        log.info("embeddings backend %s runs on %s%s", self.name, self.runtime, note)
        return loaded

    def _graph_root(self) -> Path:
        if self.graph_dir is not None:
            return self.graph_dir
        if self._temp_graphs is None:
            self._temp_graphs = Path(tempfile.mkdtemp(prefix="semcache-onnx-"))
        return self._temp_graphs

    async def start(self) -> None:
        """Load the model (seconds); called once at application start-up."""
        if self._model is None:
            self._model = await asyncio.to_thread(self._load)

    def _encode(self, texts: list[str]) -> Embeddings:
        vectors = self._model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=self.normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        counts = self.count_tokens(texts)
        return Embeddings(vectors=np.asarray(vectors, dtype=np.float32), token_counts=counts)

    async def embed(self, texts: list[str]) -> Embeddings:
        await self.start()
        async with self._lock:
            return await asyncio.to_thread(self._encode, texts)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text, counted as ``embed`` counts them (no model call)."""
        tokens = self._model.tokenizer(texts, add_special_tokens=True, truncation=True)
        return [len(ids) for ids in tokens["input_ids"]]

    def detokenize(self, token_ids: list[int]) -> str:
        text: str = self._model.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def vocab_size(self) -> int:
        return len(self._model.tokenizer)  # added tokens included

    async def ready(self) -> bool:
        return self._model is not None

    async def aclose(self) -> None:
        self._model = None
        if self._temp_graphs is not None:
            shutil.rmtree(self._temp_graphs, ignore_errors=True)
            self._temp_graphs = None
