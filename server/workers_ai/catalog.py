"""Workers AI's model search (``GET .../ai/models/search``) and model schemas
(``GET .../ai/models/schema?model=``), in Cloudflare's shapes, over the gateway's models.

One entry per model, named as ``run`` takes it: its first alias holding ``/`` (Workers AI's
``@cf/...`` form), else its id. ``search`` matches (case-insensitive, a substring) the id,
every alias and the description; ``task`` matches the task's name (``Text Generation``) or the
gateway's (``chat``); ``author`` the model's owner; ``page`` and ``per_page`` cut the list
(a page past the end is empty: the SDK's auto-paging stops there). Cloudflare's other
filters (``hide_experimental``, ``include_deprecated``, ``source``) keep every model: none
here is experimental or deprecated, and every one is Workers AI's source 1.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from backends.registry import ModelInfo
from server.errors import ApiError
from server.workers_ai.protocol import (
    EmbeddingResult,
    LabelScore,
    RerankScores,
    TextGenerationResult,
    input_schema,
)

DEFAULT_PER_PAGE: Final = 20
MAX_PER_PAGE: Final = 1000
_NAMESPACE: Final = uuid.UUID("7b0ab4a2-6f3c-5a53-9c1c-0c8e0d7f2a11")

TASKS: Final[dict[str, tuple[str, str]]] = {
    "chat": ("Text Generation", "Family of generative text models, such as large language models."),
    "embeddings": (
        "Text Embeddings",
        "Feature extraction models transform raw data into numerical features.",
    ),
    "classification": (
        "Text Classification",
        "Sentiment analysis or text classification: labels and scores for a text.",
    ),
    "rerank": (
        "Text Classification",
        "Rerankers score how relevant each context is to a query.",
    ),
}
"""Each task of the gateway as Workers AI names and describes it (rerankers are
``Text Classification`` there too)."""


class Task(msgspec.Struct, kw_only=True):
    id: str
    name: str
    description: str


class Property(msgspec.Struct, kw_only=True):
    property_id: str
    value: str


class ModelEntry(msgspec.Struct, kw_only=True):
    """A model as Workers AI's model search lists it."""

    id: str
    source: int
    name: str
    description: str
    task: Task
    created_at: str
    tags: list[str]
    properties: list[Property]


class PageInfo(msgspec.Struct, kw_only=True):
    page: int
    per_page: int
    count: int
    total_count: int


class ModelSchema(msgspec.Struct, kw_only=True):
    """A model's input and output, as JSON schemas."""

    input: dict[str, Any]
    output: dict[str, Any]


def run_name(info: ModelInfo) -> str:
    """The name a Workers AI client knows the model by."""
    return next((a for a in info.aliases if "/" in a), info.id)


def entry(info: ModelInfo) -> ModelEntry:
    task_name, task_description = TASKS[info.task]
    name = run_name(info)
    created = datetime.datetime.fromtimestamp(info.created, datetime.UTC)
    properties = [Property(property_id="model_id", value=info.id)]
    properties += [Property(property_id="alias", value=a) for a in info.aliases if a != name]
    return ModelEntry(
        id=str(uuid.uuid5(_NAMESPACE, info.id)),
        source=1,
        name=name,
        description=f"{task_name} model `{info.id}` ({info.owned_by}), served by this gateway.",
        task=Task(
            id=str(uuid.uuid5(_NAMESPACE, "task:" + task_name)),
            name=task_name,
            description=task_description,
        ),
        created_at=created.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
        tags=[],
        properties=properties,
    )


def _positive(query: Mapping[str, str], name: str, default: int, most: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise ApiError(
            400, f"`{name}` must be an integer from 1 to {most}.", param=name, code="invalid_query"
        )
    return value


def _matches(info: ModelInfo, item: ModelEntry, query: Mapping[str, str]) -> bool:
    search = query.get("search", "").strip().lower()
    if search and not any(
        search in text.lower() for text in (info.id, *info.aliases, item.description)
    ):
        return False
    task = query.get("task", "").strip().lower()
    if task and task not in (item.task.name.lower(), info.task):
        return False
    author = query.get("author", "").strip().lower()
    return not author or author == info.owned_by.lower()


def search(
    models: Iterable[ModelInfo], query: Mapping[str, str]
) -> tuple[list[ModelEntry], PageInfo]:
    """The page of ``models`` (sorted by name) that ``query`` asks for, and its info."""
    if query.get("format"):
        raise ApiError(
            400,
            f"`format={query['format']}` is not offered: models are listed in Workers AI's shape.",
            param="format",
            code="invalid_query",
        )
    page = _positive(query, "page", 1, 1_000_000)
    per_page = _positive(query, "per_page", DEFAULT_PER_PAGE, MAX_PER_PAGE)
    found = sorted(
        (item for info in models if _matches(info, item := entry(info), query)),
        key=lambda item: item.name,
    )
    start = (page - 1) * per_page
    chosen = found[start : start + per_page]
    info = PageInfo(page=page, per_page=per_page, count=len(chosen), total_count=len(found))
    return chosen, info


_OUTPUTS: Final[dict[str, Any]] = {
    "chat": TextGenerationResult,
    "embeddings": EmbeddingResult,
    "classification": list[LabelScore],
    "rerank": RerankScores,
}


def _object_schema(kind: Any, description: str) -> dict[str, Any]:
    """``kind``'s JSON schema with its definitions inlined under ``$defs``."""
    (top,), defs = msgspec.json.schema_components([kind], ref_template="#/$defs/{name}")
    ref = top.get("$ref")
    if isinstance(ref, str):
        top = dict(defs.pop(ref.rsplit("/", 1)[1]))
    schema: dict[str, Any] = {**top, "description": description}
    schema.setdefault("type", "object")
    schema.setdefault("additionalProperties", True)
    if defs:
        schema["$defs"] = defs
    return schema


def schema(info: ModelInfo) -> ModelSchema:
    """What ``run`` takes and answers for ``info``'s task."""
    task_name = TASKS[info.task][0]
    return ModelSchema(
        input=_object_schema(input_schema(info.task), f"The input of a {task_name} model."),
        output=_object_schema(_OUTPUTS[info.task], f"The result of a {task_name} model."),
    )
