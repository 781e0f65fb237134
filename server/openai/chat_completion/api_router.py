"""``POST /v1/chat/completions``."""

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
from server.openai.chat_completion.protocol import ChatCompletion, ChatCompletionRequest
from server.openai.text_generation import TextGenerationServing
from server.serving.cache_headers import directives_from


@post(
    "/v1/chat/completions",
    operation_class=documented(
        RouteDoc(
            summary="Create a chat completion",
            tag="OpenAI",
            body=ChatCompletionRequest,
            headers=CACHE_HEADERS,
            answers=(
                Answer(
                    200,
                    ChatCompletion,
                    "The completion; with `stream: true`, server-sent events.",
                    also=("text/event-stream",),
                ),
            ),
            errors=(*CLIENT_ERRORS, 404, *SERVER_ERROR, *BACKEND_ERRORS),
        )
    ),
)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc: TextGenerationServing = request.app.state.chat_completion
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


ROUTES = [chat_completions]
