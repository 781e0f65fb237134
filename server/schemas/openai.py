"""OpenAI request schemas, used to validate bodies before they are forwarded.

The structs describe the fields the gateway checks; unknown fields are allowed and the
original body (not these structs) is what reaches the backend, so fields the gateway does
not interpret pass through unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None


MAX_EMBEDDING_INPUTS = 2048


class InputError(ValueError):
    """An ``input`` item of the wrong kind; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None


def embedding_inputs(value: str | list[Any]) -> list[str] | list[list[int]]:
    """Normalise ``input`` to a list of strings or a list of token-id lists.

    OpenAI accepts a string, a list of strings, a list of token ids, or a list of those.
    """
    if isinstance(value, str):
        return [value]
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise InputError(f"input[{i}]", "Input strings must not be empty.")
        return list(value)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [list(value)]
    if all(isinstance(v, list) for v in value):
        out: list[list[int]] = []
        for i, v in enumerate(value):
            if not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise InputError(f"input[{i}]", "Expected a non-empty list of token ids.")
            out.append(v)
        return out
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
