"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from server.anthropic.protocol import MessageAnswer, MessagesRequest, TokenCount, TokenCountRequest
from server.anthropic.serving import MessagesServing
from server.apidoc.operation import (
    BACKEND_ERRORS,
    CLIENT_ERRORS,
    SERVER_ERROR,
    Answer,
    Field,
    RouteDoc,
    documented,
)
from server.apidoc.request_headers import CACHE_HEADERS, CONTEXT_HEADERS, STRING
from server.envelope.context import context
from server.http.respond import parse_body, respond
from server.serving.cache_headers import directives_from

ANTHROPIC_HEADERS = (
    Field("x-api-key", STRING, "The API token (or send `Authorization: Bearer <token>`)."),
    Field("anthropic-version", STRING, "Accepted (every version is answered alike)."),
    Field("anthropic-beta", STRING, "Accepted; no beta feature changes the answer."),
)
ERRORS = (*CLIENT_ERRORS, 403, 404, *SERVER_ERROR, *BACKEND_ERRORS, 529)


def messages(request: Request[Any, Any, Any]) -> MessagesServing:
    svc: MessagesServing = request.app.state.anthropic
    return svc


@post(
    "/v1/messages",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Create a message (Anthropic's Messages API)",
            tag="Anthropic",
            body=MessagesRequest,
            headers=(*ANTHROPIC_HEADERS, *CACHE_HEADERS),
            answers=(
                Answer(
                    200,
                    MessageAnswer,
                    "The message; with `stream: true`, Anthropic's named events "
                    "(`message_start` … `message_stop`).",
                    also=("text/event-stream",),
                ),
            ),
            errors=ERRORS,
        )
    ),
)
async def create_message(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await messages(request).create(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


@post(
    "/v1/messages/count_tokens",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Count the tokens of a message's prompt (Anthropic's Messages API)",
            tag="Anthropic",
            body=TokenCountRequest,
            headers=(*ANTHROPIC_HEADERS, *CONTEXT_HEADERS),
            answers=(Answer(200, TokenCount, "The prompt's tokens, as the model renders it."),),
            errors=ERRORS,
        )
    ),
)
async def count_tokens(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await messages(request).count_tokens(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


ROUTES = [create_message, count_tokens]
