"""``POST /v1/completions``: the request fields the gateway checks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosInt
from server.openai.protocol import SamplingFields


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: PosInt | None = None
    suffix: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    """The answer as documented (vLLM's, relayed or replayed from the cache): the fields every
    answer carries; the rest pass through."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
