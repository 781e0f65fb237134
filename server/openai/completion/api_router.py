"""``POST /v1/completions``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from server.apidoc.operation import (
    BACKEND_ERRORS,
    CLIENT_ERRORS,
    SERVER_ERROR,
    Answer,
    RouteDoc,
    documented,
)
from server.apidoc.request_headers import CACHE_HEADERS
from server.envelope.context import context
from server.http.respond import parse_body, respond
from server.openai.completion.protocol import Completion, CompletionRequest
from server.openai.text_generation import TextGenerationServing
from server.serving.cache_headers import directives_from


@post(
    "/v1/completions",
    operation_class=documented(
        RouteDoc(
            summary="Create a completion",
            tag="OpenAI",
            body=CompletionRequest,
            headers=CACHE_HEADERS,
            answers=(
                Answer(
                    200,
                    Completion,
                    "The completion; with `stream: true`, server-sent events.",
                    also=("text/event-stream",),
                ),
            ),
            errors=(*CLIENT_ERRORS, 404, *SERVER_ERROR, *BACKEND_ERRORS),
        )
    ),
)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc: TextGenerationServing = request.app.state.completion
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


ROUTES = [completions]
