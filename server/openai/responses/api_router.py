"""``POST /v1/responses`` and ``GET /v1/responses/{response_id}``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath

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
from server.openai.responses.protocol import ResponseObject, ResponsesRequest
from server.openai.responses.serving import ResponsesServing
from server.serving.cache_headers import directives_from


def responses(request: Request[Any, Any, Any]) -> ResponsesServing:
    svc: ResponsesServing = request.app.state.responses
    return svc


@post(
    "/v1/responses",
    operation_class=documented(
        RouteDoc(
            summary="Create a response",
            tag="OpenAI",
            description="Cached only when stateless: `store: false`, no `previous_response_id`, "
            "no `conversation`, not `background`.",
            body=ResponsesRequest,
            headers=CACHE_HEADERS,
            answers=(
                Answer(
                    200,
                    ResponseObject,
                    "The response; with `stream: true`, server-sent events.",
                    also=("text/event-stream",),
                ),
            ),
            errors=(*CLIENT_ERRORS, 404, *SERVER_ERROR, *BACKEND_ERRORS),
        )
    ),
)
async def create_response(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = responses(request)
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


@get(
    "/v1/responses/{response_id:str}",
    operation_class=documented(
        RouteDoc(
            summary="Retrieve a stored response",
            tag="OpenAI",
            answers=(Answer(200, ResponseObject, "The response the backend stored."),),
            errors=(400, 401, 404, 429, *SERVER_ERROR, *BACKEND_ERRORS),
        )
    ),
)
async def retrieve_response(
    request: Request[Any, Any, Any], response_id: FromPath[str]
) -> Response[Any]:
    ctx = context(request)
    return respond(await responses(request).retrieve(response_id, ctx), ctx)


ROUTES = [create_response, retrieve_response]
