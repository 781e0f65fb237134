"""``POST /v1/chat/completions``: validate, resolve the model, generate."""

from __future__ import annotations

from typing import Any

import msgspec

from backends.protocol import RequestContext
from server.openai.chat_completion.protocol import ChatCompletionRequest
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingState
from server.serving.generation import Generation
from server.serving.reply import Reply


class ChatCompletionServing:
    def __init__(self, state: ServingState, generation: Generation) -> None:
        self.state = state
        self.generation = generation

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, ChatCompletionRequest)
        info = self.state.resolve(req.model, "chat", ctx)
        return await self.generation.generate(
            "/v1/chat/completions", "chat", info, body, bool(req.stream), ctx, cache
        )
