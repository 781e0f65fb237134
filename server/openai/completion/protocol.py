"""``POST /v1/completions``: the request fields the gateway checks."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from server.openai.protocol import NonEmptyStr, PositiveInt, SamplingFields


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None
