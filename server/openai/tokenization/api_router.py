"""``POST /tokenize`` and ``POST /detokenize``, at vLLM's own paths."""

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
from server.openai.tokenization.protocol import (
    Detokenized,
    DetokenizeRequest,
    Tokenized,
    TokenizeRequest,
)
from server.openai.tokenization.serving import TokenizationServing
from server.serving.cache_headers import directives_from

ERRORS = (*CLIENT_ERRORS, 403, 404, *SERVER_ERROR, *BACKEND_ERRORS)


def tokenization(request: Request[Any, Any, Any]) -> TokenizationServing:
    svc: TokenizationServing = request.app.state.tokenization
    return svc


@post(
    "/tokenize",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Tokenize a prompt or a conversation (vLLM)",
            tag="vLLM",
            body=TokenizeRequest,
            headers=CACHE_HEADERS,
            answers=(
                Answer(200, Tokenized, "The token ids, as the model's tokenizer gives them."),
            ),
            errors=ERRORS,
        )
    ),
)
async def tokenize(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await tokenization(request).tokenize(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


@post(
    "/detokenize",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Turn token ids back into text (vLLM)",
            tag="vLLM",
            body=DetokenizeRequest,
            headers=CACHE_HEADERS,
            answers=(Answer(200, Detokenized, "The text of the token ids."),),
            errors=ERRORS,
        )
    ),
)
async def detokenize(request: Request[Any, Any, Any]) -> Response[Any]:
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await tokenization(request).detokenize(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


ROUTES = [tokenize, detokenize]
