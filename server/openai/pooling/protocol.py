"""``POST /v1/embeddings`` and ``POST /v1/classify``: the request fields the gateway checks,
and their ``input`` normalised to a list of items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosInt
from server.openai.token_ids import InputError, token_id_lists

MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PosInt | None = None
    user: str | None = None


def embedding_inputs(value: str | list[Any]) -> list[str] | list[list[int]]:
    """Normalise ``input`` to a list of strings or a list of token-id lists.

    OpenAI accepts a string, a list of strings, a list of token ids, or a list of those
    (``server.openai.token_ids`` checks the ids).
    """
    if isinstance(value, str):
        return [value]
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise InputError(f"input[{i}]", "Input strings must not be empty.")
        return list(value)
    ids = token_id_lists(value, "input")
    if ids is not None:
        return ids
    raise InputError(
        "input",
        "Expected a string, a list of strings, a list of token ids or a list of token-id lists.",
    )


class ClassificationRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/classify`` body (the fields the gateway reads)."""

    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1, max_length=2048)]
    user: str | None = None


def classification_inputs(value: str | list[Any]) -> list[str]:
    """``input`` as a list of non-empty strings (token-id input is not supported here)."""
    if isinstance(value, str):
        return [value]
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise InputError(f"input[{i}]", "Expected a string; this model classifies text.")
        if not v:
            raise InputError(f"input[{i}]", "Input strings must not be empty.")
    return list(value)


class Embedding(msgspec.Struct, kw_only=True):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str
    """Floats, or their little-endian float32 bytes in base64 (``encoding_format``)."""


class EmbeddingList(msgspec.Struct, kw_only=True):
    """The answer of ``/v1/embeddings`` as ``serving._embedding_body`` writes it (or vLLM)."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, Any]


class Classification(msgspec.Struct, kw_only=True):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationList(msgspec.Struct, kw_only=True):
    """The answer of ``/v1/classify`` as ``serving._classification_body`` writes it (or vLLM)."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Classification]
    usage: dict[str, Any]
