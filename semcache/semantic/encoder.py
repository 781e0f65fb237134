"""The semantic cache's own sentence encoder, with micro-batching of concurrent callers.

One worker thread owns the model. A request that arrives while the worker is idle is
encoded at once (no added wait); requests that arrive while a batch is running queue up
and are encoded together in the next batch, which is cheaper per text than one model call
each.

The model comes from outside: ``backends.local.sentence_model`` loads one, and the app factory
(``server.encoders``) wraps it in an :class:`Encoder`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np


class TextModel(Protocol):
    """The part of a sentence-transformers model the encoder uses."""

    def encode(self, sentences: list[str], **kwargs: Any) -> Any: ...


@dataclass
class _Request:
    texts: list[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]


@dataclass
class EncoderStats:
    """Counters for tests and metrics."""

    model_calls: int = 0
    texts: int = 0
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)


class Encoder:
    """Async, micro-batched sentence encoder returning L2-normalised float32 vectors."""

    def __init__(
        self,
        model: TextModel,
        *,
        dimensions: int,
        version: str,
        max_batch_texts: int = 256,
        model_batch_size: int = 64,
        runtime: str = "torch",
    ) -> None:
        self.model = model
        self.runtime = runtime
        """What runs the forward pass: ``torch`` or ``onnx``."""
        self.dimensions = dimensions
        self.version = version
        self.max_batch_texts = max_batch_texts
        self.model_batch_size = model_batch_size
        self.stats = EncoderStats()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    async def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of shape (len(texts), dimensions), one row per text, in order."""
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        if self._closed:
            raise RuntimeError("encoder is closed")
        self._ensure_worker()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._queue.put(_Request(list(texts), loop, future))
        return await future

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as the model sees them (special tokens included, truncated)."""
        tokenizer = getattr(self.model, "tokenizer", None)
        if tokenizer is None or not texts:
            return [len(text.split()) for text in texts]
        ids = tokenizer(list(texts), add_special_tokens=True, truncation=True)["input_ids"]
        return [len(row) for row in ids]

    def encode_sync(self, texts: Sequence[str], *, show_progress: bool = False) -> np.ndarray:
        """Blocking encode in the caller's thread, for offline work (training, benchmarks)."""
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        return self._run_model(list(texts), show_progress=show_progress)

    async def aclose(self) -> None:
        """Stop the worker thread (pending requests are still answered)."""
        self._closed = True
        worker = self._worker
        if worker is not None:
            self._queue.put(None)
            await asyncio.to_thread(worker.join)
            self._worker = None

    def _ensure_worker(self) -> None:
        if self._worker is not None:
            return
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve, name="semcache-encoder", daemon=True
                )
                self._worker.start()

    def _serve(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            size = len(first.texts)
            # Everything that queued up while the previous batch ran goes in this one.
            while size < self.max_batch_texts:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
                size += len(nxt.texts)
            self._encode_batch(batch)

    def _encode_batch(self, batch: list[_Request]) -> None:
        texts = [text for request in batch for text in request.texts]
        try:
            vectors = self._run_model(texts)
        except Exception as exc:
            for request in batch:
                request.loop.call_soon_threadsafe(_set_exception, request.future, exc)
            return
        self.stats.requests += len(batch)
        self.stats.batch_sizes.append(len(texts))
        start = 0
        for request in batch:
            end = start + len(request.texts)
            request.loop.call_soon_threadsafe(_set_result, request.future, vectors[start:end])
            start = end

    def _run_model(self, texts: list[str], *, show_progress: bool = False) -> np.ndarray:
        if not show_progress and len(texts) <= self.model_batch_size:
            raw = _forward(self.model, texts)
        else:
            raw = None
        if raw is None:  # many texts (sorted by length and batched by the library), or a fake
            raw = self.model.encode(
                texts,
                batch_size=self.model_batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=show_progress,
            )
        self.stats.model_calls += 1
        self.stats.texts += len(texts)
        vectors = np.ascontiguousarray(raw, dtype=np.float32)
        # Normalise again in float32: the model's own normalisation may run in another dtype.
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)


def _forward(model: Any, texts: list[str]) -> np.ndarray | None:
    """One forward pass of a sentence-transformers model over one batch, or None.

    The same modules and outputs as ``model.encode`` (bit-identical for one text), without
    its per-call bookkeeping.
    """
    prepare = getattr(model, "preprocess", None) or getattr(model, "tokenize", None)
    if prepare is None or not callable(model):
        return None
    import torch

    with torch.inference_mode():
        features = prepare(texts)
        device = getattr(model, "device", None)
        if device is not None:
            features = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()
            }
        embedding = model(features)["sentence_embedding"]
        return cast(np.ndarray, embedding.float().cpu().numpy())


def _set_result(future: asyncio.Future[np.ndarray], value: np.ndarray) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[np.ndarray], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
