"""``POST /v1/responses``: the request fields the gateway checks (the rest pass through)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosInt
from server.openai.protocol import Penalty, Temperature, TopP


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool | None = None
    store: bool | None = None
    """OpenAI's default (and vLLM's) is true: the answer is kept for later requests."""
    previous_response_id: NonEmptyStr | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @property
    def stateful(self) -> bool:
        """The answer is kept on the server, or depends on what it kept: never cached."""
        return (
            self.store is not False
            or self.previous_response_id is not None
            or self.conversation is not None
            or bool(self.background)
        )


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response as documented (vLLM's, relayed or replayed from the cache): the fields every
    answer carries; the rest pass through."""

    id: str
    object: Literal["response"]
    created_at: int | float
    model: str
    status: str
    output: list[dict[str, Any]]
