"""The embedded default text classifier: sentiment (POSITIVE / NEGATIVE) over MiniLM.

It stands in for Workers AI's default ``@cf/huggingface/distilbert-sst2-int8`` and backs
``POST /v1/classify``: a logistic-regression head over the sentence encoder's vectors,
trained on ``backends/local/data/sentiment/sentiment.jsonl`` (390 labelled sentences written for
this project, see ``data/NOTICE.md``). The head ships as package data
(``backends/local/data/classifier/sentiment-head.json``); retrain it with
``semcache train-classifier``. A head trained for another encoder
version is retrained in memory at load (a second or two).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from foundation.package_files import package_file

if TYPE_CHECKING:
    from foundation.request import RequestContext

log = logging.getLogger(__name__)

DATA_DIR = package_file("backends.local", "data")
DEFAULT_EXAMPLES = DATA_DIR / "sentiment" / "sentiment.jsonl"
DEFAULT_HEAD = DATA_DIR / "classifier" / "sentiment-head.json"
LABELS = ("NEGATIVE", "POSITIVE")

LabelScores = list[tuple[str, float]]


def label_names(labels: Sequence[str], count: int) -> list[str]:
    """``count`` label names: ``labels``, then transformers' ``LABEL_<i>`` for any not known
    (a vLLM classifier without a model folder learns its names from vLLM's answers)."""
    return [labels[i] if i < len(labels) else f"LABEL_{i}" for i in range(count)]


class TextEncoder(Protocol):
    """What the classifier needs from an encoder (``semcache.semantic.encoder.Encoder``)."""

    version: str
    dimensions: int

    async def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def encode_sync(self, texts: Sequence[str], *, show_progress: bool = False) -> np.ndarray: ...

    def count_tokens(self, texts: Sequence[str]) -> list[int]: ...


class TextClassifierBackend(Protocol):
    """A classification model of the registry, as ``/v1/classify`` serves it.

    Satisfied by the embedded :class:`ClassifierBackend` and by
    ``backends.vllm.classifier.VllmClassifier`` (a vLLM sequence-classification model).
    """

    name: str
    fixed_revision: str | None
    """A revision known up front (config or model folder); None: :attr:`version` once started."""
    uses_encoder: bool
    """True when :meth:`start` needs the semantic cache's encoder (the embedded classifier)."""

    async def start(self, encoder: TextEncoder | None = None) -> object:
        """Get ready to classify (idempotent)."""
        ...

    @property
    def labels(self) -> list[str]:
        """Every label, in the order of the probabilities a cached answer stores."""
        ...

    @property
    def version(self) -> str: ...

    async def classify(
        self, texts: Sequence[str], ctx: RequestContext | None = None
    ) -> list[LabelScores]:
        """Per text, every label with its score (sum 1), best first."""
        ...

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, as the model counts them (usage of cached items too)."""
        ...

    async def ready(self) -> bool: ...

    async def aclose(self) -> None: ...


class Example(msgspec.Struct):
    text: str
    label: str


class LinearHead(msgspec.Struct, kw_only=True):
    """Softmax regression weights over normalised sentence vectors."""

    labels: list[str]
    weights: list[list[float]]
    """dimensions x labels"""
    bias: list[float]
    encoder_version: str
    examples: int
    version: str = ""

    def digest(self) -> str:
        payload = msgspec.json.encode([self.labels, self.weights, self.bias])
        return "h-" + hashlib.sha256(payload).hexdigest()[:12]


def load_examples(path: Path = DEFAULT_EXAMPLES) -> list[Example]:
    decoder = msgspec.json.Decoder(Example)
    return [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


def train_head(
    vectors: np.ndarray,
    labels: Sequence[str],
    *,
    label_names: Sequence[str] = LABELS,
    encoder_version: str,
    l2: float = 1e-3,
    steps: int = 3000,
    learning_rate: float = 2.0,
) -> LinearHead:
    """Full-batch gradient descent on the softmax cross-entropy (deterministic)."""
    index = {name: i for i, name in enumerate(label_names)}
    y = np.zeros((len(labels), len(label_names)), dtype=np.float64)
    y[np.arange(len(labels)), [index[label] for label in labels]] = 1.0
    x = np.asarray(vectors, dtype=np.float64)
    w = np.zeros((x.shape[1], len(label_names)))
    b = np.zeros(len(label_names))
    for _ in range(steps):
        probs = _softmax(x @ w + b)
        grad = probs - y
        w -= learning_rate * (x.T @ grad / len(x) + l2 * w)
        b -= learning_rate * grad.mean(axis=0)
    head = LinearHead(
        labels=list(label_names),
        weights=w.astype(np.float32).tolist(),
        bias=b.astype(np.float32).tolist(),
        encoder_version=encoder_version,
        examples=len(labels),
    )
    head.version = head.digest()
    return head


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return np.asarray(exp / exp.sum(axis=1, keepdims=True))


class TextClassifier:
    """``classify(texts)``: per text, every label with its score (sum 1), best first."""

    def __init__(self, encoder: TextEncoder, head: LinearHead, *, name: str = "sentiment") -> None:
        self.encoder = encoder
        self.head = head
        self.name = name
        self.labels = list(head.labels)
        self._w = np.asarray(head.weights, dtype=np.float32)
        self._b = np.asarray(head.bias, dtype=np.float32)

    @property
    def version(self) -> str:
        """Changes when the head or the encoder changes (a cache key part)."""
        return f"{self.name}-{self.head.version}+{self.encoder.version}"

    async def classify(self, texts: Sequence[str]) -> list[LabelScores]:
        if not texts:
            return []
        return self.classify_vectors(await self.encoder.encode(texts))

    def classify_vectors(self, vectors: np.ndarray) -> list[LabelScores]:
        """Scores for texts already encoded by this classifier's encoder."""
        probs = _softmax(np.asarray(vectors, dtype=np.float32) @ self._w + self._b)
        results: list[LabelScores] = []
        for row in probs:
            order = np.argsort(-row, kind="stable")
            results.append([(self.labels[i], float(row[i])) for i in order])
        return results


def build_head(encoder: TextEncoder, examples_path: Path = DEFAULT_EXAMPLES) -> LinearHead:
    examples = load_examples(examples_path)
    vectors = encoder.encode_sync([e.text for e in examples])
    return train_head(vectors, [e.label for e in examples], encoder_version=encoder.version)


def load_classifier(
    encoder: TextEncoder,
    head_path: Path = DEFAULT_HEAD,
    examples_path: Path = DEFAULT_EXAMPLES,
) -> TextClassifier:
    """The shipped sentiment classifier on ``encoder`` (blocking; call at startup)."""
    head: LinearHead | None = None
    if head_path.is_file():
        head = msgspec.json.decode(head_path.read_bytes(), type=LinearHead)
        if head.encoder_version != encoder.version or head.version != head.digest():
            log.warning(
                "classifier head %s was trained for encoder %s, not %s: retraining in memory",
                head_path,
                head.encoder_version,
                encoder.version,
            )
            head = None
    if head is None:
        head = build_head(encoder, examples_path)
    return TextClassifier(encoder, head)


class ClassifierBackend:
    """A classifier model of the registry, run in process on an encoder given at start.

    The encoder is the semantic cache's own (one MiniLM in memory); the server loads it on
    the first classification request and calls :meth:`start` with it.
    """

    uses_encoder = True

    def __init__(
        self, name: str, head_path: Path = DEFAULT_HEAD, *, revision: str | None = None
    ) -> None:
        self.name = name
        self.head_path = head_path
        self.fixed_revision = revision
        """A revision set in the config; None: the model's revision is :attr:`version`."""
        self.classifier: TextClassifier | None = None
        self._lock = asyncio.Lock()

    async def start(self, encoder: TextEncoder | None = None) -> TextClassifier:
        """Load the head for ``encoder`` (retrained in memory if it was trained for another)."""
        if self.classifier is None:
            if encoder is None:
                raise RuntimeError(f"classifier {self.name} needs an encoder to start")
            async with self._lock:
                if self.classifier is None:
                    self.classifier = await asyncio.to_thread(
                        load_classifier, encoder, self.head_path
                    )
        return self.classifier

    @property
    def labels(self) -> list[str]:
        return list(self._loaded().labels)

    @property
    def version(self) -> str:
        return self._loaded().version

    def _loaded(self) -> TextClassifier:
        if self.classifier is None:
            raise RuntimeError(f"classifier {self.name} is not started")
        return self.classifier

    async def classify(
        self, texts: Sequence[str], ctx: RequestContext | None = None
    ) -> list[LabelScores]:
        return await self._loaded().classify(texts)

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as the encoder counts them (no model call)."""
        return self._loaded().encoder.count_tokens(texts)

    async def ready(self) -> bool:
        return self.classifier is not None

    async def aclose(self) -> None:
        self.classifier = None


def save_head(head: LinearHead, path: Path) -> None:
    """Write a head where :func:`load_classifier` reads it (``semcache train-classifier``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(head))
