"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's paths): validated here, answered by the
core's tokenization (``server/serving/tokenization.py``: cached, tenant-scoped)."""

from __future__ import annotations

from typing import Any

import msgspec

from backends.registry import ModelInfo
from foundation.request import RequestContext
from server.errors import ApiError
from server.http.reply import Reply
from server.identity.auth import check_model
from server.openai.tokenization.protocol import DetokenizeRequest, TokenizeRequest
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore, unknown_model
from server.serving.tokenization import Tokenization


class TokenizationServing:
    def __init__(self, core: ServingCore, tokens: Tokenization) -> None:
        self.core = core
        self.tokens = tokens

    def resolve(self, name: str, ctx: RequestContext) -> ModelInfo:
        """Any model a vLLM backend serves (chat, classification, rerank): vLLM has its
        tokenizer. A 400 for a model the gateway runs itself."""
        info = self.core.registry.resolve(name)
        if info is None:
            raise unknown_model(name)
        check_model(ctx.models, name, info)
        if info.backend_name not in self.core.registry.generation:
            raise ApiError(
                400,
                f"The model `{name}` is not served by vLLM: it has no tokenizer endpoint here.",
                param="model",
                code="model_task_mismatch",
            )
        return info

    async def tokenize(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None
    ) -> Reply:
        req = msgspec.convert(body, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(
                400, "Send exactly one of `prompt` and `messages`.", code="invalid_value"
            )
        info = self.resolve(req.model, ctx)
        return await self.tokens.run("tokenize", info, body, ctx, directives)

    async def detokenize(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None
    ) -> Reply:
        req = msgspec.convert(body, DetokenizeRequest)
        info = self.resolve(req.model, ctx)
        return await self.tokens.run("detokenize", info, body, ctx, directives)
