"""What a semantic entry is: its partition, its text, its vector and where its answer lives."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from semcache.semantic.verified.decisions import Observation


class PartitionKey(msgspec.Struct, frozen=True, kw_only=True):
    """One hard partition of the semantic index; a search never crosses partitions.

    ``matcher`` names the encoder and verifier versions, so retraining either one starts
    fresh partitions instead of mixing vectors or decisions of two models.
    """

    scope: str
    """Tenant scope (a tenant id, or a shared scope name)."""
    model_revision: str
    task: str
    template: str
    """Fingerprint of the prompt/chat template and of any request option that changes answers."""
    matcher: str = ""

    def digest(self) -> str:
        """A stable file-name-safe name of the partition."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:32]


class IndexEntry(msgspec.Struct, kw_only=True, gc=False):
    """One cached text in a partition."""

    id: int
    text: str
    payload_ref: str
    """Opaque key under which the caller keeps the answer (in the exact tiers)."""
    expires_at: float
    """Unix time after which the entry is never served and is removed."""
    created_at: float
    observations: list[Observation] = []
    """Judged explores of a verified partition (``semcache.semantic.verified.decisions``)."""


class SemanticRecord(msgspec.Struct, kw_only=True):
    """Everything needed to add an entry to an index elsewhere (another gateway, a rebuild)."""

    partition: PartitionKey
    text: str
    payload_ref: str
    expires_at: float
    created_at: float
    vector: bytes
    """float32, little-endian, L2-normalised."""
    origin: str = ""
    """Which gateway wrote it (a feed ignores its own records)."""
    observations: list[Observation] = []
    """The entry's judged explores; a record read again merges them into the entry's."""

    def vector_array(self) -> np.ndarray:
        return np.frombuffer(self.vector, dtype="<f4").astype(np.float32, copy=False)


def vector_bytes(vector: np.ndarray) -> bytes:
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()
