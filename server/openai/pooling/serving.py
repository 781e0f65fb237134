"""``POST /v1/embeddings`` and ``POST /v1/classify`` (and their GET forms): the request
validated in OpenAI's shape, the model resolved, the texts read; the core does the rest."""

from __future__ import annotations

from typing import Any

import msgspec

from foundation.request import RequestContext
from server.errors import ApiError
from server.http.reply import Reply
from server.openai.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    classification_inputs,
    embedding_inputs,
)
from server.openai.token_ids import InputError, out_of_vocabulary
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.pooling import Pooling


def invalid_input(exc: InputError) -> ApiError:
    return ApiError(400, str(exc), param=exc.param, code="invalid_value")


class PoolingServing:
    def __init__(self, core: ServingCore, generation: Generation, pooling: Pooling) -> None:
        self.core = core
        self.generation = generation
        """Embeddings of a model served by a generation backend (vLLM) take its path."""
        self.pooling = pooling

    async def embeddings(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, EmbeddingRequest)
        info = self.core.resolve(req.model, "embeddings", ctx)
        try:
            items = embedding_inputs(req.input)
        except InputError as exc:
            raise invalid_input(exc) from None
        if info.backend_name in self.core.registry.generation:  # vLLM checks its vocabulary
            return await self.generation.generate(
                "/v1/embeddings", "embeddings", info, body, False, ctx, cache
            )
        backend = self.core.registry.embedding_backend(info)
        await backend.start()
        ids = [item for item in items if not isinstance(item, str)]
        if (unknown := out_of_vocabulary(ids, backend.vocab_size(), "input")) is not None:
            raise invalid_input(unknown)
        if req.dimensions is not None and req.dimensions != backend.dimensions:
            raise ApiError(
                400,
                f"The model `{info.id}` only supports dimensions={backend.dimensions}.",
                param="dimensions",
                code="invalid_value",
            )
        texts = [t if isinstance(t, str) else backend.detokenize(t) for t in items]
        return await self.pooling.embed(
            info, texts, body, ctx, cache, encoding_format=req.encoding_format
        )

    async def classify(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        """``POST /v1/classify`` in vLLM's shape."""
        req = msgspec.convert(body, ClassificationRequest)
        info = self.core.resolve(req.model, "classification", ctx)
        self.pooling.classifier_of(info)
        try:
            texts = classification_inputs(req.input)
        except InputError as exc:
            raise invalid_input(exc) from None
        return await self.pooling.classify(info, texts, body, ctx, cache)
