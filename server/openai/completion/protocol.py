"""``POST /v1/completions``: the request fields the gateway checks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosInt
from server.openai.protocol import SamplingFields
from server.openai.token_ids import InputError, token_id_lists


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: NonEmptyStr | Annotated[list[Any], msgspec.Meta(min_length=1)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: PosInt | None = None
    suffix: str | None = None


def check_prompt(req: CompletionRequest) -> None:
    """A ``prompt`` list is strings, token ids or token-id lists (ids checked as
    ``server.openai.token_ids`` does; vLLM checks them against its vocabulary)."""
    prompt = req.prompt
    if isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
        return
    if token_id_lists(prompt, "prompt") is None:
        raise InputError(
            "prompt",
            "Expected a string, a list of strings, a list of token ids or a list of "
            "token-id lists.",
        )


class Completion(msgspec.Struct, kw_only=True):
    """The answer as documented (vLLM's, relayed or replayed from the cache): the fields every
    answer carries; the rest pass through."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
