"""Declarative description of the backends a gateway talks to (validated once at load)."""

from __future__ import annotations

from typing import Literal

import msgspec

ServerRole = Literal["both", "prefill", "decode"]


class VllmLaunch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How `semcache serve` / `semcache backends up` starts one vLLM server itself."""

    cpu_cores: str | None = None
    """Cores to pin the server's OpenMP threads to on CPU (``VLLM_CPU_OMP_THREADS_BIND``)."""
    kv_cache_gib: float = 1.0
    block_size: int | None = None
    max_model_len: int | None = 2048
    enforce_eager: bool = True
    extra_args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    nixl_side_channel_port: int | None = None


class VllmServer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One vLLM OpenAI-protocol server."""

    url: str
    role: ServerRole = "both"
    launch: VllmLaunch | None = None
    """Present when the gateway starts this server itself; absent for a server run elsewhere."""


class VllmBackend(
    msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="kind", tag="vllm"
):
    """A pool of vLLM servers serving one model."""

    name: str
    served_model: str
    """The model name vLLM answers to (``--served-model-name``)."""
    model_path: str | None = None
    """HF folder of the weights; ``prepared:NAME`` names a model the gateway prepares itself."""
    revision: str | None = None
    """Explicit revision; by default a hash of the files under ``model_path``."""
    servers: list[VllmServer] = msgspec.field(default_factory=list)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    max_connections: int = 256


class LocalEmbeddingBackend(
    msgspec.Struct,
    forbid_unknown_fields=True,
    kw_only=True,
    tag_field="kind",
    tag="local-embeddings",
):
    """A sentence-transformers model run in the gateway's own process."""

    name: str
    model_path: str
    """A folder, or ``package:NAME`` for a model shipped inside a Python package."""
    revision: str | None = None
    max_batch_size: int = 64
    normalize: bool = True


class EmbeddedClassifierBackend(
    msgspec.Struct,
    forbid_unknown_fields=True,
    kw_only=True,
    tag_field="kind",
    tag="embedded-classifier",
):
    """The embedded text classifier (a linear head over the semantic cache's encoder)."""

    name: str
    head_path: str | None = None
    """The head's JSON file; default: the shipped sentiment head (``data/classifier``)."""
    revision: str | None = None
    """Explicit revision; by default the head's and the encoder's versions."""


BackendConfig = VllmBackend | LocalEmbeddingBackend | EmbeddedClassifierBackend
