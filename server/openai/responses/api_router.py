"""``POST /v1/responses`` and ``GET /v1/responses/{response_id}``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath

from server.caching import directives_from
from server.openai.routing import context, parse_body, respond, serving


@post("/v1/responses")
async def create_response(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).responses
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


@get("/v1/responses/{response_id:str}")
async def retrieve_response(
    request: Request[Any, Any, Any], response_id: FromPath[str]
) -> Response[Any]:
    ctx = context(request)
    return respond(await serving(request).responses.retrieve(response_id, ctx), ctx)


ROUTES = [create_response, retrieve_response]
