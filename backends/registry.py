"""The model registry: public model names (OpenAI ids and Workers-AI aliases) → backends."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import msgspec

from backends.chat_templates import template_fingerprint, template_path
from backends.config import EmbeddedClassifierConfig, LocalEmbeddingConfig, VllmBackendConfig
from backends.generation_defaults import launch_defaults
from backends.interfaces import EmbeddingBackend, GenerationBackend
from backends.local.classifier import DEFAULT_HEAD, ClassifierBackend, TextClassifierBackend
from backends.local.embedding import LocalEmbeddingBackend
from backends.models import chat_template_fingerprint, model_revision, prepare_model
from backends.vllm.classifier import VllmClassifier
from backends.vllm.client import VllmClient

Task = Literal["chat", "embeddings", "classification", "rerank"]


@dataclass(frozen=True)
class ModelInfo:
    """Everything the layers above need to know about one exposed model."""

    id: str
    task: Task
    aliases: tuple[str, ...]
    owned_by: str
    backend_name: str
    revision: str
    """Hash of the weights/config files: part of every cache key for this model."""
    chat_template_fp: str
    created: int = 0
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """What the backend fills omitted sampling fields with (``backends.generation_defaults``):
    part of the canonical request bytes, so of every key."""


@dataclass
class ModelRegistry:
    models: dict[str, ModelInfo] = field(default_factory=dict)
    generation: dict[str, GenerationBackend] = field(default_factory=dict)
    embedding: dict[str, EmbeddingBackend] = field(default_factory=dict)
    classifiers: dict[str, TextClassifierBackend] = field(default_factory=dict)
    """Embedded classifiers, and ``task = "classify"`` vLLM backends (whose clients are in
    ``generation`` too: health, capacity and metrics treat them as any vLLM backend)."""
    _by_name: dict[str, ModelInfo] = field(default_factory=dict)

    def add(self, info: ModelInfo) -> None:
        self.models[info.id] = info
        for name in (info.id, *info.aliases):
            self._by_name[name] = info

    def resolve(self, name: str) -> ModelInfo | None:
        """Find a model by OpenAI id or alias."""
        return self._by_name.get(name)

    def set_revision(self, backend_name: str, revision: str) -> None:
        """Give every model of a backend a new revision (known only once it is loaded)."""
        for info in list(self.models.values()):
            if info.backend_name == backend_name and info.revision != revision:
                self.add(dataclasses.replace(info, revision=revision))

    async def check_revisions(self) -> None:
        """Ask the vLLM backends versioned by their servers for their revision now (start-up;
        the health checks keep asking)."""
        await asyncio.gather(
            *(
                g.monitor.check_all()
                for g in self.generation.values()
                if isinstance(g, VllmClient) and g.monitor.served_model is not None
            )
        )

    def classifier_backend(self, info: ModelInfo) -> TextClassifierBackend:
        return self.classifiers[info.backend_name]

    def generation_backend(self, info: ModelInfo) -> GenerationBackend:
        return self.generation[info.backend_name]

    def embedding_backend(self, info: ModelInfo) -> EmbeddingBackend:
        return self.embedding[info.backend_name]

    async def aclose(self) -> None:
        for g in self.generation.values():
            await g.aclose()
        for e in self.embedding.values():
            await e.aclose()
        for c in self.classifiers.values():
            await c.aclose()


@dataclass(frozen=True)
class ModelSpec:
    """A model entry of the config, as the registry needs it (no server imports)."""

    id: str
    backend: str
    task: Task
    aliases: tuple[str, ...]
    owned_by: str


def _resolve_path(spec: str | None, data_dir: Path) -> Path | None:
    if spec is None:
        return None
    return prepare_model(spec, data_dir, progress=lambda _msg: None)


def backend_sampling_defaults(config: VllmBackendConfig, model_dir: Path | None) -> dict[str, Any]:
    """The sampling defaults every server of a vLLM backend applies: read from the checkpoint
    with each launched server's ``--generation-config`` / ``--override-generation-config``
    (a server run elsewhere: vLLM's default, ``auto``). Servers that disagree are refused:
    one key cannot stand for two answers."""
    found: list[dict[str, Any]] = []
    launch_args = [s.launch.extra_args if s.launch else [] for s in config.servers] or [[]]
    for args in launch_args:
        each = launch_defaults(model_dir, args)
        if each not in found:
            found.append(each)
    if len(found) > 1:
        raise ValueError(
            f"backend {config.name!r}: its servers apply different sampling defaults "
            f"({found}); launch them with the same --generation-config"
        )
    return found[0]


def build_registry(
    models: list[ModelSpec],
    backends: list[VllmBackendConfig | LocalEmbeddingConfig | EmbeddedClassifierConfig],
    data_dir: Path,
    created: int = 0,
    encoder_dir: Path | None = None,
) -> ModelRegistry:
    """Create the backend clients and compute each model's revision (cached on disk).

    ``encoder_dir``: where local embedding models keep their exported graphs, shared with the
    semantic cache's encoder (default ``data_dir/encoders``)."""
    reg = ModelRegistry()
    revisions: dict[str, tuple[str, str]] = {}
    defaults: dict[str, dict[str, Any]] = {}
    for b in backends:
        if isinstance(b, EmbeddedClassifierConfig):
            head = Path(b.head_path) if b.head_path else DEFAULT_HEAD
            digest = hashlib.sha256(head.read_bytes()).hexdigest()[:12]
            # Refined to the head's and the encoder's versions when the classifier starts.
            revisions[b.name] = (b.revision or f"head-{digest}", "none")
            reg.classifiers[b.name] = ClassifierBackend(b.name, head, revision=b.revision)
            continue
        path = _resolve_path(b.model_path, data_dir)
        if b.revision:
            rev = b.revision
        elif path is not None:
            rev = model_revision(path)
        else:
            # no files to hash: until its servers report one (backends.fleet.remote_revision)
            rev = f"unversioned:{b.name}"
        template_fp = chat_template_fingerprint(path) if path is not None else "none"
        if isinstance(b, VllmBackendConfig) and b.chat_template is not None:
            template_fp = template_fingerprint(template_path(b.chat_template).read_text())
        revisions[b.name] = (rev, template_fp)
        if isinstance(b, VllmBackendConfig):
            defaults[b.name] = backend_sampling_defaults(b, path)
            if path is not None and b.model_path != str(path):
                # the folder a prepared: or package: spec names: KV placement's tokenizer
                b = msgspec.structs.replace(b, model_path=str(path))
            client = VllmClient(b)
            if client.monitor.served_model is not None:
                client.monitor.on_revision = partial(reg.set_revision, b.name)
            reg.generation[b.name] = client
            if b.task == "classify":
                reg.classifiers[b.name] = VllmClassifier(client, revision=rev, model_dir=path)
        else:
            assert path is not None
            reg.embedding[b.name] = LocalEmbeddingBackend(
                b.name,
                path,
                normalize=b.normalize,
                batch_size=b.max_batch_size,
                runtime=b.runtime,
                graph_dir=encoder_dir or data_dir / "encoders",
            )
    for m in models:
        rev, template_fp = revisions[m.backend]
        reg.add(
            ModelInfo(
                id=m.id,
                task=m.task,
                aliases=m.aliases,
                owned_by=m.owned_by,
                backend_name=m.backend,
                revision=rev,
                chat_template_fp=template_fp,
                created=created,
                sampling_defaults=defaults.get(m.backend, {}),
            )
        )
    return reg
