"""``POST /v1/chat/completions``: the request fields the gateway checks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from foundation.config_types import PosInt
from server.openai.protocol import SamplingFields

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """The answer as documented (vLLM's, relayed or replayed from the cache): the fields every
    answer carries; the rest pass through."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
