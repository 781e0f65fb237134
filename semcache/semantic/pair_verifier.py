"""The second stage of a semantic lookup: do two texts mean the same?

The ANN search proposes candidates by cosine; cosine alone cannot tell "How do I lose
10 kg?" from "How do I lose 30 kg?". The verifier is a small MLP over the encoder's pair
features (``u*v``, ``|u-v|``, cosine) plus a few cheap lexical features of the two texts
(number and word overlap), trained on labelled question pairs by
``semcache train-verifier``. Inference is plain numpy (microseconds per
pair). Its version is a hash of its weights and goes into every partition key, so
retraining invalidates old semantic entries.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from foundation.package_files import package_file

DEFAULT_VERIFIER_DIR = package_file("semcache.semantic", "data", "verifier")
WEIGHTS_FILE = "verifier.npz"
META_FILE = "verifier.json"
FEATURE_SPEC = "uv+absdiff+cos+lex14/v2"

_WORD = re.compile(r"[a-z0-9]+")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
_CAPITALISED = re.compile(r"\b[A-Z][A-Za-z]+")
_STOP = frozenset(
    "a an the is are was were be been being do does did of in on at to for from by with and or"
    " what how why which who whom when where can could should would will i you we my your me it"
    " its this that these those there some any as into about than then so if".split()
)
_QUESTION_WORDS = ("what", "how", "why", "which", "who", "when", "where")
_NEGATIONS = frozenset(
    "not no never nor none cannot without isn aren wasn weren don doesn didn won can"
    " shouldn couldn wouldn".split()
)
LEXICAL_FEATURES = 14


class Setting(msgspec.Struct, kw_only=True, frozen=True):
    """A (cosine threshold, verifier probability) operating point."""

    threshold: float
    min_prob: float


class SplitMetrics(msgspec.Struct, kw_only=True):
    pairs: int
    positives: int
    precision: float
    recall: float
    hit_rate: float


class VerifierMeta(msgspec.Struct, kw_only=True):
    """What is known about a trained verifier (written next to its weights)."""

    version: str
    feature_spec: str
    encoder_version: str
    hidden: int
    recommended: Setting
    """Chosen on the validation split for ``target_precision``; never on test."""
    target_precision: float
    validation: SplitMetrics
    test: SplitMetrics
    """Held-out test split at the recommended setting (never used for any choice)."""
    test_cosine_only: list[SplitMetrics] = msgspec.field(default_factory=list)
    training: dict[str, str | int | float] = msgspec.field(default_factory=dict)


def lexical_features(texts_a: Sequence[str], texts_b: Sequence[str]) -> np.ndarray:
    """Cheap symmetric word-level facts of each pair that a pooled sentence vector blurs.

    Word / content-word / bigram overlap, numbers and capitalised names that differ, the
    question word, a negation on one side only, and word order (swapped entities such as
    "from India to Canada" vs "from Canada to India" keep the same words).
    """
    rows = np.zeros((len(texts_a), LEXICAL_FEATURES), dtype=np.float32)
    for i, (a, b) in enumerate(zip(texts_a, texts_b, strict=True)):
        rows[i] = _lexical(a, b)
    return rows


def _jaccard(x: set[Any], y: set[Any]) -> float:
    union = x | y
    return len(x & y) / len(union) if union else 1.0


def _lexical(a: str, b: str) -> list[float]:
    words_a, words_b = _WORD.findall(a.lower()), _WORD.findall(b.lower())
    set_a, set_b = set(words_a), set(words_b)
    content_a, content_b = set_a - _STOP, set_b - _STOP
    numbers_a, numbers_b = set(_NUMBER.findall(a)), set(_NUMBER.findall(b))
    names_a, names_b = set(_CAPITALISED.findall(a[1:])), set(_CAPITALISED.findall(b[1:]))
    question_a = next((w for w in words_a if w in _QUESTION_WORDS), "")
    question_b = next((w for w in words_b if w in _QUESTION_WORDS), "")
    position_b: dict[str, int] = {}
    for index, word in enumerate(words_b):
        position_b.setdefault(word, index)
    order = [position_b[w] for w in dict.fromkeys(words_a) if w in content_b]
    inversions = sum(
        1 for i in range(len(order)) for j in range(i + 1, len(order)) if order[i] > order[j]
    )
    order_pairs = max(1, len(order) * (len(order) - 1) // 2)
    only_a, only_b = len(content_a - content_b), len(content_b - content_a)
    longer = max(len(a), len(b), 1)
    return [
        _jaccard(set_a, set_b),
        _jaccard(content_a, content_b),
        _jaccard(set(pairwise(words_a)), set(pairwise(words_b))),
        float(numbers_a == numbers_b),
        float(bool(numbers_a ^ numbers_b)),
        float(min(len(names_a ^ names_b), 5)),
        float(question_a == question_b),
        float(bool(set_a & _NEGATIONS) != bool(set_b & _NEGATIONS)),
        float(min(len(content_a ^ content_b), 10)),
        float(min(abs(len(words_a) - len(words_b)), 20)),
        inversions / order_pairs,
        min(len(a), len(b)) / longer,
        float(min(only_a, only_b)),
        float(max(only_a, only_b)),
    ]


def pair_features(
    u: np.ndarray, v: np.ndarray, texts_a: Sequence[str], texts_b: Sequence[str]
) -> np.ndarray:
    """Symmetric features of each (u[i], v[i]) pair; order of the two texts does not matter."""
    u = np.asarray(u, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    cos = np.sum(u * v, axis=1, keepdims=True)
    return np.hstack([u * v, np.abs(u - v), cos, lexical_features(texts_a, texts_b)]).astype(
        np.float32
    )


def weights_version(weights: dict[str, np.ndarray]) -> str:
    """A hash of the weights' names, shapes and values (independent of the file container)."""
    digest = hashlib.sha256(FEATURE_SPEC.encode())
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name], dtype=np.float32)
        digest.update(name.encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return "v-" + digest.hexdigest()[:12]


class PairVerifier:
    """A two-layer MLP: features -> standardise -> ReLU(W1) -> sigmoid(W2)."""

    def __init__(self, weights: dict[str, np.ndarray], meta: VerifierMeta | None = None) -> None:
        self.weights = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        self.version = weights_version(self.weights)
        self.meta = meta
        self._mean = self.weights["mean"]
        self._scale = self.weights["scale"]
        self._w1 = self.weights["w1"]
        self._b1 = self.weights["b1"]
        self._w2 = self.weights["w2"]
        self._b2 = self.weights["b2"]

    @property
    def recommended(self) -> Setting | None:
        return self.meta.recommended if self.meta is not None else None

    def probabilities(
        self,
        u: np.ndarray,
        v: np.ndarray,
        texts_a: Sequence[str],
        texts_b: Sequence[str],
    ) -> np.ndarray:
        """P(same meaning) for each pair (u[i], texts_a[i]) vs (v[i], texts_b[i])."""
        if len(texts_a) == 0:
            return np.zeros(0, dtype=np.float32)
        return self.probabilities_of_features(pair_features(u, v, texts_a, texts_b))

    def probabilities_of_features(self, features: np.ndarray) -> np.ndarray:
        x = (features - self._mean) / self._scale
        hidden = np.maximum(x @ self._w1 + self._b1, 0.0)
        logits = (hidden @ self._w2 + self._b2).reshape(-1)
        return np.exp(-np.logaddexp(0.0, -logits)).astype(np.float32)  # sigmoid, no overflow

    def save(self, folder: Path, meta: VerifierMeta) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = dict(self.weights)
        np.savez_compressed(folder / WEIGHTS_FILE, **arrays)
        (folder / META_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(meta)))


class VerifierMismatch(Exception):
    """The weights do not match their metadata (corrupt or half-updated files)."""


def load_verifier(folder: Path | str = DEFAULT_VERIFIER_DIR) -> PairVerifier:
    """Load the shipped verifier (package data, ``semcache/semantic/data/verifier``); checks
    its version hash."""
    folder = Path(folder)
    with np.load(folder / WEIGHTS_FILE) as archive:
        weights = {name: archive[name] for name in archive.files}
    meta = msgspec.json.decode((folder / META_FILE).read_bytes(), type=VerifierMeta)
    verifier = PairVerifier(weights, meta)
    if meta.version != verifier.version:
        raise VerifierMismatch(f"weights hash {verifier.version} != recorded {meta.version}")
    if meta.feature_spec != FEATURE_SPEC:
        raise VerifierMismatch(f"feature spec {meta.feature_spec} != {FEATURE_SPEC}")
    return verifier
