"""Workers AI's inputs per task, its success envelope and its error entries."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
import orjson

from foundation.config_types import NonEmptyStr, PosInt
from server.errors import WORKERS_AI, ApiError

DEFAULT_MAX_TOKENS: Final = 256
DEFAULT_TEMPERATURE: Final = 0.6
"""Workers AI's defaults for text generation (they differ from OpenAI's); the policy's
``max_tokens`` default, where its rule has one, comes before this one."""


class TextGenerationInput(msgspec.Struct, kw_only=True):
    """Workers AI text-generation input (``prompt`` or ``messages``)."""

    prompt: NonEmptyStr | None = None
    messages: list[dict[str, Any]] | None = None
    raw: bool = False
    stream: bool = False
    max_tokens: PosInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=5.0)] = DEFAULT_TEMPERATURE
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=1, le=50)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=1, le=9_999_999_999)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    response_format: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``auto``, ``none``, ``required``, or a function (OpenAI's object, or
    ``{"type": "function", "name": ...}``)."""
    lora: str | None = None


class EmbeddingInput(msgspec.Struct, kw_only=True):
    text: NonEmptyStr | Annotated[list[NonEmptyStr], msgspec.Meta(min_length=1)]
    pooling: Literal["mean", "cls"] = "mean"


class ClassificationInput(msgspec.Struct, kw_only=True):
    text: NonEmptyStr


class RerankContext(msgspec.Struct, kw_only=True):
    text: str


class RerankInput(msgspec.Struct, kw_only=True):
    """Workers AI's reranker input (``@cf/baai/bge-reranker-base``)."""

    query: NonEmptyStr
    contexts: Annotated[list[RerankContext], msgspec.Meta(min_length=1)]
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None


class RerankScore(msgspec.Struct, kw_only=True):
    id: int
    score: float


class RerankScores(msgspec.Struct, kw_only=True):
    """A reranker's answer: each context's index (``id``) and score, best first."""

    response: list[RerankScore]
    usage: Usage


class QueuedBatch(msgspec.Struct, kw_only=True):
    """A batch submission (``?queueRequest=true``): the items, each its task's input plus an
    optional ``external_reference`` (checked by ``BatchService.submit``)."""

    requests: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]
    queueRequest: bool | None = None  # Cloudflare's name
    options: dict[str, Any] | None = None


class PollRequest(msgspec.Struct, kw_only=True):
    """A poll of a queued batch: its ``request_id``."""

    request_id: NonEmptyStr


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TextGenerationResult(msgspec.Struct, kw_only=True):
    response: str
    usage: Usage
    tool_calls: list[dict[str, Any]] | None = None


class EmbeddingResult(msgspec.Struct, kw_only=True):
    shape: list[int]
    data: list[list[float]]
    pooling: str
    usage: Usage


class LabelScore(msgspec.Struct, kw_only=True):
    label: str
    score: float


class Queued(msgspec.Struct, kw_only=True):
    """The answer to a batch submission, and to a poll while the batch runs."""

    status: str
    request_id: str
    model: str | None = None


class BatchResponses(msgspec.Struct, kw_only=True):
    """The answer to a poll once the batch is done: one response object per item."""

    responses: list[dict[str, Any]]
    usage: Usage


def input_schema(task: str) -> type[Any]:
    """The input struct of a model's task."""
    if task == "chat":
        return TextGenerationInput
    if task == "embeddings":
        return EmbeddingInput
    if task == "rerank":
        return RerankInput
    return ClassificationInput


def envelope(result: Any) -> bytes:
    """Cloudflare's success envelope."""
    return orjson.dumps({"result": result, "success": True, "errors": [], "messages": []})


def error_object(err: ApiError) -> dict[str, Any]:
    """An entry of the envelope's ``errors`` (the codes ``server.errors`` uses)."""
    return {"code": err.status * 10, "message": err.said_by(WORKERS_AI)}


def truthy(value: Any) -> bool:
    """A ``queueRequest`` flag, from the query string (text) or the body (JSON)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return value is True
