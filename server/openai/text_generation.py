"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one serving class, an
instance per family (its path, the cache's route name, its request schema)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from foundation.request import RequestContext
from server.errors import ApiError
from server.http.reply import Reply
from server.openai.token_ids import InputError
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
        check: Callable[[Any], None] | None = None,
    ) -> None:
        """``check``: what the schema cannot say of a request (``InputError``: a 400)."""
        self.core = core
        self.generation = generation
        self.path = path
        self.route = route
        self.schema = schema
        self.check = check

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, self.schema)
        if self.check is not None:
            try:
                self.check(req)
            except InputError as exc:
                raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        info = self.core.resolve(req.model, "chat", ctx)
        return await self.generation.generate(
            self.path, self.route, info, body, bool(req.stream), ctx, cache
        )
