"""``POST /v1/embeddings`` and ``POST /v1/classify``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from server.caching import directives_from
from server.openai.routing import context, parse_body, respond, serving


@post("/v1/embeddings")
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).pooling
    return respond(await svc.embeddings(body, ctx, directives_from(request.headers)), ctx)


@post("/v1/classify")
async def classify(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).pooling
    return respond(await svc.classify(body, ctx, directives_from(request.headers)), ctx)


ROUTES = [embeddings, classify]
