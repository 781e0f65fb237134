"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one serving class, an
instance per family (its path, the cache's route name, its request schema)."""

from __future__ import annotations

from typing import Any

import msgspec

from foundation.request import RequestContext
from server.http.reply import Reply
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.generation import Generation


class TextGenerationServing:
    """Validate with the family's schema, resolve the model, generate."""

    def __init__(
        self,
        core: ServingCore,
        generation: Generation,
        *,
        path: str,
        route: str,
        schema: type[Any],
    ) -> None:
        self.core = core
        self.generation = generation
        self.path = path
        self.route = route
        self.schema = schema

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, self.schema)
        info = self.core.resolve(req.model, "chat", ctx)
        return await self.generation.generate(
            self.path, self.route, info, body, bool(req.stream), ctx, cache
        )
