"""``/v1/embeddings`` and ``/v1/classify``: the POST forms (a JSON body) and the GET forms
(a query string, see ``query.py``), one serving path for both."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post

from server.caching import directives_from
from server.openai.pooling.query import query_body
from server.openai.routing import context, parse_body, respond, serving


@post("/v1/embeddings")
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).pooling
    return respond(await svc.embeddings(body, ctx, directives_from(request.headers)), ctx)


@get("/v1/embeddings")
async def embeddings_get(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = query_body(request.scope["query_string"], "embeddings")
    reply = await serving(request).pooling.embeddings(body, ctx, directives_from(request.headers))
    return respond(reply, ctx, if_none_match=request.headers.get("if-none-match"))


@post("/v1/classify")
async def classify(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    svc = serving(request).pooling
    return respond(await svc.classify(body, ctx, directives_from(request.headers)), ctx)


@get("/v1/classify")
async def classify_get(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = query_body(request.scope["query_string"], "classification")
    reply = await serving(request).pooling.classify(body, ctx, directives_from(request.headers))
    return respond(reply, ctx, if_none_match=request.headers.get("if-none-match"))


ROUTES = [embeddings, embeddings_get, classify, classify_get]
