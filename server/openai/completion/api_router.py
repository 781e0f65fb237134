"""``POST /v1/completions``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from server.caching import directives_from
from server.openai.routing import context, parse_body, respond, serving


@post("/v1/completions")
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).completion
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


ROUTES = [completions]
