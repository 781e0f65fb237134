"""In-process embedding backend: a sentence-transformers model run in a worker thread."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np

from backends.protocol import Embeddings


class LocalEmbeddingBackend:
    """Encodes texts with a local sentence-transformers model (one encode at a time)."""

    def __init__(self, name: str, model_dir: Path, *, normalize: bool = True, batch_size: int = 64):
        self.name = name
        self.model_dir = model_dir
        self.normalize = normalize
        self.batch_size = batch_size
        self.dimensions = 0
        self._model: Any = None
        self._lock = asyncio.Lock()

    def _load(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self.model_dir), device="cpu")
        self.dimensions = int(model.get_embedding_dimension() or 0)
        return model

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
        tokens = self._model.tokenizer(texts, add_special_tokens=True, truncation=True)
        counts = [len(ids) for ids in tokens["input_ids"]]
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

    async def ready(self) -> bool:
        return self._model is not None

    async def aclose(self) -> None:
        self._model = None
