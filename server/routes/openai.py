"""OpenAI-compatible routes: read the body, hand it to the serving object, send the reply."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath

from backends.protocol import RequestContext
from server.auth import tenant_from
from server.caching import directives_from
from server.serving import OpenAIServing, Reply, aclose_stream, parse_body
from server.speedups import RelayStream


def serving(request: Request[Any, Any, Any]) -> OpenAIServing:
    svc: OpenAIServing = request.app.state.serving
    return svc


def context(request: Request[Any, Any, Any]) -> RequestContext:
    headers = request.headers
    return RequestContext(
        request_id=headers.get("x-request-id") or uuid.uuid4().hex,
        session_affinity=headers.get("x-session-affinity"),
        tenant=tenant_from(headers),
    )


def respond(reply: Reply, ctx: RequestContext | None = None) -> Response[Any]:
    headers = dict(reply.headers)
    if ctx is not None:
        headers["x-request-id"] = ctx.request_id
    if reply.stream is not None:
        return RelayStream(
            reply.stream,
            status_code=reply.status,
            media_type=reply.media_type,
            headers=headers,
            # When the client leaves, Litestar stops sending and leaves the generator suspended
            # at its `yield`: its `finally` (which aborts the backend and keeps a partial
            # answer out of the cache) would otherwise run only at garbage collection.
            background=BackgroundTask(aclose_stream, reply.stream),
        )
    return Response(
        reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers
    )


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request[Any, Any, Any]) -> Response[Any]:
    return respond(serving(request).list_models())


@get("/v1/models/{model:path}", sync_to_thread=False)
def get_model(request: Request[Any, Any, Any], model: FromPath[str]) -> Response[Any]:
    return respond(serving(request).get_model(model.lstrip("/")))


@post("/v1/chat/completions")
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await serving(request).chat(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


@post("/v1/completions")
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(
        await serving(request).completions(body, ctx, directives_from(request.headers)), ctx
    )


@post("/v1/embeddings")
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(
        await serving(request).embeddings(body, ctx, directives_from(request.headers)), ctx
    )


@post("/v1/classify")
async def classify(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(
        await serving(request).classify(body, ctx, directives_from(request.headers)), ctx
    )


ROUTES = [list_models, get_model, chat_completions, completions, embeddings, classify]
