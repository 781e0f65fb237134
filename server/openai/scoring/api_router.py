"""``POST /v1/score`` and ``POST /v1/rerank``: a cross-encoder's scores (vLLM's pooling
runner), cached per (query, document) pair."""

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
from server.openai.scoring.protocol import RerankList, RerankRequest, ScoreList, ScoreRequest
from server.openai.scoring.serving import ScoringServing
from server.serving.cache_headers import directives_from

ERRORS = (*CLIENT_ERRORS, 403, 404, *SERVER_ERROR, *BACKEND_ERRORS)


def scoring(request: Request[Any, Any, Any]) -> ScoringServing:
    svc: ScoringServing = request.app.state.scoring
    return svc


@post(
    "/v1/score",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Score text pairs with a cross-encoder (vLLM)",
            tag="vLLM",
            body=ScoreRequest,
            headers=CACHE_HEADERS,
            answers=(Answer(200, ScoreList, "One score per pair, in order."),),
            errors=ERRORS,
        )
    ),
)
async def score(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(await scoring(request).score(body, ctx, directives_from(request.headers)), ctx)


@post(
    "/v1/rerank",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Rerank documents against a query (Jina/Cohere shape, as vLLM serves it)",
            tag="vLLM",
            body=RerankRequest,
            headers=CACHE_HEADERS,
            answers=(Answer(200, RerankList, "The documents, most relevant first."),),
            errors=ERRORS,
        )
    ),
)
async def rerank(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await scoring(request).rerank(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


ROUTES = [score, rerank]
