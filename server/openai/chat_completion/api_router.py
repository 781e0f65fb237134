"""``POST /v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from server.caching import directives_from
from server.openai.routing import context, parse_body, respond, serving


@post("/v1/chat/completions")
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).chat_completion
    return respond(await svc.create(body, ctx, directives_from(request.headers)), ctx)


ROUTES = [chat_completions]
