"""A text classifier served by vLLM: a sequence-classification model behind ``POST /classify``.

It answers in the classifier contract (``backends.local.classifier.TextClassifierBackend``) that the
embedded classifier answers in, so ``/v1/classify`` and Workers-AI text classification take
one serving path (per-item semantic cache in front) for both.

- Requests go through the backend's ``VllmClient`` (pooled aiohttp session, socket timeouts,
  health checks, admission and retries on another server; failures as ``BackendError``).
- Labels: vLLM answers, per text, its top ``label`` (from the model's ``id2label``) and
  ``probs`` in class-index order. The full label list, in index order, is read from the
  model's ``config.json`` (``id2label``) when the gateway has the model folder
  (``model_path``): the very list vLLM names labels from. Without the folder (a server run
  elsewhere) the labels are ``LABEL_<i>`` (transformers' default names) until vLLM's answers
  name them. Every answer is checked against the list: a top label that is not the one the
  list gives means the folder is not the served model, and the answer is refused (not cached).
- Token counts (``usage`` and the cache's per-item counts): the model's own tokenizer from the
  folder, loaded at start (vLLM's ``/classify`` reports one total per request, not per text);
  without a folder, vLLM's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from backends.interfaces import BackendError, UpstreamRejected
from backends.local.classifier import LabelScores, TextEncoder
from backends.vllm.client import VllmClient
from foundation.request import RequestContext

CLASSIFY_PATH = "/classify"
TOKENIZE_PATH = "/tokenize"


def labels_from_config(model_dir: Path) -> list[str]:
    """The model's labels in class-index order (``id2label`` of its ``config.json``)."""
    try:
        config = orjson.loads((model_dir / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    id2label = config.get("id2label") if isinstance(config, dict) else None
    if not isinstance(id2label, dict) or not id2label:
        return []
    try:
        by_index = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        return []
    if sorted(by_index) != list(range(len(by_index))):
        return []
    return [by_index[i] for i in range(len(by_index))]


class VllmClassifier:
    """A ``task = "classify"`` vLLM backend as a classifier of the registry."""

    uses_encoder = False
    """The semantic cache's encoder is not needed to classify (only to cache)."""

    def __init__(self, client: VllmClient, *, revision: str, model_dir: Path | None = None) -> None:
        self.client = client
        self.name = client.name
        self.served_model = client.served_model
        self.model_dir = model_dir
        self.fixed_revision: str | None = revision
        """The model's revision (a hash of its folder, or the config's): fixed, never refined."""
        self._labels: list[str] = labels_from_config(model_dir) if model_dir else []
        self._labels_known = bool(self._labels)
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def start(self, encoder: TextEncoder | None = None) -> VllmClassifier:
        """Load the model's tokenizer (for token counts) once; ``encoder`` is not used."""
        if self._tokenizer is None and self.model_dir is not None:
            async with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        return self

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        assert self.model_dir is not None
        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def version(self) -> str:
        assert self.fixed_revision is not None
        return self.fixed_revision

    async def classify(
        self, texts: Sequence[str], ctx: RequestContext | None = None
    ) -> list[LabelScores]:
        """Per text, every label with its probability, best first (vLLM's order on ties)."""
        if not texts:
            return []
        ctx = ctx or RequestContext(request_id=f"classify-{uuid.uuid4().hex}")
        body = {"model": self.served_model, "input": list(texts)}
        answer = await self.client.post(CLASSIFY_PATH, body, ctx)
        if answer.status in (404, 405):  # the path or the served model is not there
            refused = UpstreamRejected.from_answer(answer.status, answer.body)
            raise BackendError(
                "broken",
                f"vLLM backend {self.name} answered {answer.status} to /classify "
                f"({refused.message}): is it a classification model named {self.served_model!r}?",
            )
        if answer.status != 200:
            raise UpstreamRejected.from_answer(answer.status, answer.body)
        rows = self._rows(answer.body, len(texts))
        results: list[LabelScores] = []
        for probs in rows:
            order = sorted(range(len(probs)), key=lambda i: -probs[i])
            results.append([(self._labels[i], probs[i]) for i in order])
        return results

    def _rows(self, body: bytes, count: int) -> list[list[float]]:
        """Each text's probabilities in class-index order; a malformed answer is ``broken``."""
        where = f"vLLM backend {self.name}"
        try:
            data = orjson.loads(body)["data"]
            items = sorted(data, key=lambda item: int(item["index"]))
            rows = [[float(p) for p in item["probs"]] for item in items]
            top = [item.get("label") for item in items]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise BackendError("broken", f"{where} gave a malformed /classify answer") from None
        if [int(item["index"]) for item in items] != list(range(count)):
            raise BackendError("broken", f"{where} answered {len(items)} of {count} texts")
        classes = {len(row) for row in rows}
        if len(classes) != 1 or not all(math.isfinite(p) for row in rows for p in row):
            raise BackendError("broken", f"{where} gave malformed probabilities")
        (n,) = classes
        if not self._labels:
            self._labels = [f"LABEL_{i}" for i in range(n)]
        if n != len(self._labels):
            raise BackendError(
                "broken", f"{where} answered {n} classes; its config lists {len(self._labels)}"
            )
        for row, label in zip(rows, top, strict=True):
            best = max(range(n), key=row.__getitem__)
            if label is None or label == self._labels[best]:
                continue
            if self._labels_known:
                raise BackendError(
                    "broken",
                    f"{where} labelled class {best} {label!r}; the model's config says "
                    f"{self._labels[best]!r} (is model_path the served model?)",
                )
            self._labels[best] = str(label)  # learnt from the server itself
        return rows

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as vLLM counts them (special tokens included)."""
        if not texts:
            return []
        if self._tokenizer is not None:
            ids = self._tokenizer(list(texts), add_special_tokens=True)["input_ids"]
            return [len(row) for row in ids]
        counts = []
        for text in texts:
            ctx = RequestContext(request_id=f"tokenize-{uuid.uuid4().hex}")
            body = {"model": self.served_model, "prompt": text}
            answer = await self.client.post(TOKENIZE_PATH, body, ctx)
            count = None
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                count = orjson.loads(answer.body).get("count")
            if answer.status != 200 or not isinstance(count, int):
                raise BackendError("broken", f"vLLM backend {self.name} could not count tokens")
            counts.append(count)
        return counts

    async def ready(self) -> bool:
        return await self.client.ready()

    async def aclose(self) -> None:
        """Nothing of its own: the registry closes the client (a generation backend too)."""
        self._tokenizer = None
