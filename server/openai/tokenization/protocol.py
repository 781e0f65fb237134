"""vLLM's ``/tokenize`` and ``/detokenize``: the fields the gateway checks (the rest pass
through to vLLM, which validates them)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from foundation.config_types import NonEmptyStr
from server.openai.token_ids import MAX_TOKEN_ID

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A ``prompt`` (text), or ``messages`` rendered with the model's chat template (and its
    ``tools``), as vLLM takes them."""

    model: NonEmptyStr
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    tokens: list[TokenId]


class Tokenized(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(msgspec.Struct, kw_only=True):
    prompt: str
