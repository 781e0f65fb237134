"""``/v1/responses``: create a response through the caches to its backend, or fetch one that
a backend kept.

Only stateless requests (``store: false``, no ``previous_response_id``, ``conversation`` or
``background``) may be cached: a stored response is one the client may fetch or continue
later by its id, and a cached answer would hand out the id of a response another request
made. Stateful requests go to the backend as they are.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import msgspec

from backends.protocol import RequestContext, StoredResponses
from server.caching import CacheDirectives
from server.errors import ApiError
from server.openai.generation import Generation
from server.openai.reply import Reply
from server.openai.responses.protocol import ResponsesRequest
from server.openai.state import ServingState

PATH = "/v1/responses"


def response_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param="response_id",
        type="invalid_request_error",
    )


class ResponsesServing:
    def __init__(self, state: ServingState, generation: Generation) -> None:
        self.state = state
        self.generation = generation

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, ResponsesRequest)
        info = self.state.resolve(req.model, "chat")
        directives = None if req.stateful else cache
        return await self.generation.generate(
            PATH, "responses", info, body, bool(req.stream), ctx, directives
        )

    async def retrieve(self, response_id: str, ctx: RequestContext) -> Reply:
        """The response a backend kept (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``)."""
        registry = self.state.registry
        for backend in registry.generation.values():
            if not isinstance(backend, StoredResponses):
                continue
            found = await backend.fetch(f"{PATH}/{quote(response_id, safe='')}", ctx)
            if found is not None and found.status != 404:
                return Reply(found.status, found.body, media_type=found.content_type)
        raise response_not_found(response_id)
