"""``/v1/responses``: create a response through the caches to its backend, or fetch one that
a backend kept.

Only stateless requests (``store: false``, no ``previous_response_id``, ``conversation`` or
``background``) may be cached: a stored response is one the client may fetch or continue
later by its id, and a cached answer would hand out the id of a response another request
made. Stateful requests go to the backend as they are.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any
from urllib.parse import quote

import msgspec

from backends.interfaces import StoredResponses
from foundation.request import RequestContext
from server.errors import ApiError
from server.http.reply import Reply, aclose_stream
from server.openai.responses.owners import ResponseOwners, response_id_in
from server.openai.responses.protocol import ResponsesRequest
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.generation import Generation

PATH = "/v1/responses"


def response_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param="response_id",
        type="invalid_request_error",
    )


def without_nulls(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without its top-level nulls, which the Responses API reads as the field's
    default (and so do the cache keys: ``"background": null`` and no ``background`` are one
    request).

    vLLM (checked against 0.32) accepts a null ``background`` or ``truncation`` but builds its
    final ``response.completed`` event with them, whose model declares them non-null: the
    stream is cut after it began, and a non-streamed request is refused.
    """
    return {name: value for name, value in body.items() if value is not None}


class ResponsesServing:
    def __init__(
        self, core: ServingCore, generation: Generation, owners: ResponseOwners | None = None
    ) -> None:
        """``owners``: who made each stored response (stored responses are then scoped by
        tenant; ``None``: unscoped, for tests of the relay alone)."""
        self.core = core
        self.generation = generation
        self.owners = owners

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        body = without_nulls(body)
        req = msgspec.convert(body, ResponsesRequest)
        info = self.core.resolve(req.model, "chat", ctx)
        previous = req.previous_response_id
        if previous is not None and not await self._owned(ctx, previous):
            raise ApiError(
                404,
                f"Previous response with id '{previous}' not found.",
                param="previous_response_id",
                type="invalid_request_error",
            )
        directives = None if req.stateful else cache
        reply = await self.generation.generate(
            PATH, "responses", info, body, bool(req.stream), ctx, directives
        )
        if req.store is False or self.owners is None or reply.status != 200:
            return reply
        if reply.stream is None:
            response_id = response_id_in(reply.body)
            if response_id is not None:
                await self.owners.remember(ctx.tenant or "", response_id)
            return reply
        reply.stream = self._remembering(reply.stream, ctx.tenant or "")
        return reply

    async def _owned(self, ctx: RequestContext, response_id: str) -> bool:
        return self.owners is None or await self.owners.owns(ctx.tenant or "", response_id)

    async def _remembering(
        self, stream: AsyncIterable[bytes], tenant: str
    ) -> AsyncGenerator[bytes, None]:
        """``stream``, recording its response's owner at its first event that names it."""
        assert self.owners is not None
        seen = False
        try:
            async for chunk in stream:
                if not seen:
                    response_id = response_id_in(chunk)
                    if response_id is not None:
                        seen = True
                        await self.owners.remember(tenant, response_id)
                yield chunk
        finally:
            await aclose_stream(stream)

    async def retrieve(self, response_id: str, ctx: RequestContext) -> Reply:
        """The response a backend kept (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``),
        if this tenant made it."""
        if not await self._owned(ctx, response_id):
            raise response_not_found(response_id)
        registry = self.core.registry
        for backend in registry.generation.values():
            if not isinstance(backend, StoredResponses):
                continue
            found = await backend.fetch(f"{PATH}/{quote(response_id, safe='')}", ctx)
            if found is not None and found.status != 404:
                return Reply(found.status, found.body, media_type=found.content_type)
        raise response_not_found(response_id)
