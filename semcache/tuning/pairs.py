"""Labelled text pairs: loading, a deterministic leak-free split, and cached embeddings.

The split groups pairs by connected component of their texts (two pairs sharing a question
land in the same part), so the held-out test part contains no question seen in training.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from semcache.semantic.encoder import Encoder

Split = Literal["train", "val", "test"]

CHECKOUT_DATA_DIR = Path(__file__).resolve().parents[2] / "data"
"""Training and evaluation pairs kept in the source checkout, not shipped in the package
(Quora's terms cover the QQP texts, see ``data/NOTICE.md``): bench, tests and the default
of ``semcache train-verifier`` read them."""
QQP_PAIRS = CHECKOUT_DATA_DIR / "qqp" / "qqp_pairs_dev.jsonl.gz"
PARAPHRASE_PAIRS = CHECKOUT_DATA_DIR / "paraphrase" / "paraphrase_pairs.jsonl"
EMBEDDING_CACHE_DIR = Path(".data") / "embeddings"
"""Relative to the working directory, as the gateway's ``data_dir``."""

SPLIT_FRACTIONS: dict[Split, float] = {"train": 0.6, "val": 0.2, "test": 0.2}


class Pair(msgspec.Struct, frozen=True):
    """Two texts and whether they mean the same (1) or not (0); -1 when unlabelled."""

    text_a: str
    text_b: str
    label: int = -1


class _ParaphraseRow(msgspec.Struct):
    origin: str
    similar: str


PAIR_FORMS = (
    '{"text_a": …, "text_b": …, "label": 0 or 1} (or the paraphrase form {"origin": …, '
    '"similar": …}, read as label 1)'
)


def load_pairs(path: Path | str) -> list[Pair]:
    """Read a JSONL (optionally .gz) file of ``{"text_a","text_b","label"}`` rows.

    Rows of the paraphrase form ``{"origin","similar"}`` are read as label-1 pairs. A row
    of neither form is a ``ValueError`` naming the file, the line and both forms.
    """
    path = Path(path)
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    pairs: list[Pair] = []
    pair_decoder = msgspec.json.Decoder(Pair)
    para_decoder = msgspec.json.Decoder(_ParaphraseRow)
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            if b'"origin"' in line and b'"text_a"' not in line:
                row = para_decoder.decode(line)
                pairs.append(Pair(row.origin, row.similar, 1))
            else:
                pairs.append(pair_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{number}: {exc}; expected {PAIR_FORMS}") from None
    return pairs


def split_of(component: str) -> Split:
    """Which part a component (named by its smallest text) belongs to; stable forever."""
    bucket = int.from_bytes(hashlib.sha256(component.encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for name, fraction in SPLIT_FRACTIONS.items():
        edge += fraction
        if bucket < edge:
            return name
    return "test"


def split_pairs(pairs: Sequence[Pair]) -> dict[Split, list[Pair]]:
    """Partition pairs into train/val/test by connected component of their texts."""
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        root = text
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(text, text) != root:  # path compression
            parent[text], text = root, parent[text]
        return root

    for pair in pairs:
        a, b = find(pair.text_a), find(pair.text_b)
        if a != b:
            # The smaller text names the component, so the names do not depend on order.
            low, high = sorted((a, b))
            parent[high] = low
    parts: dict[Split, list[Pair]] = {"train": [], "val": [], "test": []}
    for pair in pairs:
        parts[split_of(find(pair.text_a))].append(pair)
    return parts


def unique_texts(pairs: Iterable[Pair]) -> list[str]:
    """Every text of the pairs once, sorted (a stable order for caching)."""
    texts = {text for pair in pairs for text in (pair.text_a, pair.text_b)}
    return sorted(texts)


class EmbeddedTexts:
    """Vectors for a fixed list of texts, looked up by text."""

    def __init__(self, texts: list[str], vectors: np.ndarray) -> None:
        self.texts = texts
        self.vectors = vectors
        self._row = {text: i for i, text in enumerate(texts)}

    def of(self, texts: Sequence[str]) -> np.ndarray:
        return self.vectors[[self._row[text] for text in texts]]

    def pair_vectors(self, pairs: Sequence[Pair]) -> tuple[np.ndarray, np.ndarray]:
        return self.of([p.text_a for p in pairs]), self.of([p.text_b for p in pairs])


def embed_texts(
    encoder: Encoder,
    texts: list[str],
    *,
    cache_dir: Path | None = EMBEDDING_CACHE_DIR,
    show_progress: bool = True,
) -> EmbeddedTexts:
    """Encode texts once per encoder version, caching the matrix under ``.data/embeddings``."""
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = cache_dir / f"{encoder.version}-{digest}.npy" if cache_dir is not None else None
    if path is not None and path.is_file():
        vectors = np.load(path)
        if vectors.shape == (len(texts), encoder.dimensions):
            return EmbeddedTexts(texts, vectors)
    vectors = encoder.encode_sync(texts, show_progress=show_progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, vectors)
        tmp.replace(path)
    return EmbeddedTexts(texts, vectors)
