"""``/v1/embeddings`` and ``/v1/classify``: the POST forms (a JSON body) and the GET forms
(a query string, see ``query.py``), one serving path for both."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post

from server.apidoc.operation import (
    BACKEND_ERRORS,
    CLIENT_ERRORS,
    SERVER_ERROR,
    Answer,
    Field,
    RouteDoc,
    documented,
)
from server.apidoc.request_headers import CACHE_HEADERS, STRING
from server.envelope.context import context
from server.http.respond import parse_body, respond
from server.openai.pooling.protocol import (
    ClassificationList,
    ClassificationRequest,
    EmbeddingList,
    EmbeddingRequest,
)
from server.openai.pooling.query import query_body
from server.openai.pooling.serving import PoolingServing
from server.serving.cache_headers import directives_from


def pooling(request: Request[Any, Any, Any]) -> PoolingServing:
    svc: PoolingServing = request.app.state.pooling
    return svc


POST_ERRORS = (*CLIENT_ERRORS, 404, *SERVER_ERROR, *BACKEND_ERRORS)
GET_ERRORS = (400, 401, 404, 414, 429, *SERVER_ERROR, *BACKEND_ERRORS)
QUERY = (
    Field("model", STRING, "The model id or alias.", required=True),
    Field(
        "input",
        {"type": "array", "items": STRING, "minItems": 1},
        "A text; repeat the parameter for several, in order.",
        required=True,
    ),
    Field("user", STRING, "End-user id (passed through)."),
)
GET_HEADERS = (
    *CACHE_HEADERS,
    Field("if-none-match", STRING, "An ETag of this answer: 304 when it still matches."),
)
NOT_MODIFIED = (Answer(304, None, "Not modified: the answer still has this ETag."),)


@post(
    "/v1/embeddings",
    operation_class=documented(
        RouteDoc(
            summary="Create embeddings",
            tag="OpenAI",
            body=EmbeddingRequest,
            headers=CACHE_HEADERS,
            answers=(Answer(200, EmbeddingList, "One embedding per input, in order."),),
            errors=POST_ERRORS,
        )
    ),
)
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(
        await pooling(request).embeddings(body, ctx, directives_from(request.headers)), ctx
    )


@get(
    "/v1/embeddings",
    operation_class=documented(
        RouteDoc(
            summary="Create embeddings (GET form, cacheable by HTTP caches)",
            tag="OpenAI",
            query=(
                *QUERY,
                Field("encoding_format", {"enum": ["float", "base64"]}, "`float` or `base64`."),
                Field("dimensions", {"type": "integer", "minimum": 1}, "Output dimensions."),
            ),
            headers=GET_HEADERS,
            answers=(
                Answer(200, EmbeddingList, "One embedding per input, in order."),
                *NOT_MODIFIED,
            ),
            errors=GET_ERRORS,
        )
    ),
)
async def embeddings_get(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = query_body(request.scope["query_string"], "embeddings")
    reply = await pooling(request).embeddings(body, ctx, directives_from(request.headers))
    return respond(reply, ctx, if_none_match=request.headers.get("if-none-match"))


@post(
    "/v1/classify",
    operation_class=documented(
        RouteDoc(
            summary="Classify texts",
            tag="OpenAI",
            body=ClassificationRequest,
            headers=CACHE_HEADERS,
            answers=(Answer(200, ClassificationList, "Labels and probabilities per input."),),
            errors=POST_ERRORS,
        )
    ),
)
async def classify(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    return respond(
        await pooling(request).classify(body, ctx, directives_from(request.headers)), ctx
    )


@get(
    "/v1/classify",
    operation_class=documented(
        RouteDoc(
            summary="Classify texts (GET form, cacheable by HTTP caches)",
            tag="OpenAI",
            query=QUERY,
            headers=GET_HEADERS,
            answers=(
                Answer(200, ClassificationList, "Labels and probabilities per input."),
                *NOT_MODIFIED,
            ),
            errors=GET_ERRORS,
        )
    ),
)
async def classify_get(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = query_body(request.scope["query_string"], "classification")
    reply = await pooling(request).classify(body, ctx, directives_from(request.headers))
    return respond(reply, ctx, if_none_match=request.headers.get("if-none-match"))


ROUTES = [embeddings, embeddings_get, classify, classify_get]
