"""The Workers-AI route: read the body, hand it to the Workers-AI serving object."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.openapi.spec import Link
from litestar.params import FromPath

from server.apidoc.operation import (
    BACKEND_ERRORS,
    CLIENT_ERRORS,
    SERVER_ERROR,
    Answer,
    AnyOf,
    Field,
    RouteDoc,
    documented,
)
from server.apidoc.request_headers import CACHE_HEADERS
from server.envelope.context import context
from server.http.respond import parse_body, respond
from server.serving.cache_headers import directives_from
from server.workers_ai.protocol import (
    BatchResponses,
    ClassificationInput,
    EmbeddingInput,
    EmbeddingResult,
    LabelScore,
    PollRequest,
    Queued,
    QueuedBatch,
    RerankInput,
    RerankScores,
    TextGenerationInput,
    TextGenerationResult,
    truthy,
)
from server.workers_ai.serving import WorkersAIServing


def workers_ai(request: Request[Any, Any, Any]) -> WorkersAIServing:
    svc: WorkersAIServing = request.app.state.workers_ai
    return svc


RESULT = AnyOf(
    (TextGenerationResult, EmbeddingResult, list[LabelScore], RerankScores, Queued, BatchResponses)
)
ENVELOPE = {
    "type": "object",
    "required": ["result", "success", "errors", "messages"],
    "properties": {
        "result": RESULT,
        "success": {"const": True},
        "errors": {"type": "array", "maxItems": 0},
        "messages": {"type": "array"},
    },
}
"""Cloudflare's success envelope (``protocol.envelope``)."""

RUN_DOC = RouteDoc(
    summary="Run a model (Workers AI), queue a batch, or poll one",
    tag="Workers AI",
    error_format="workers_ai",
    description=(
        "The body is the model's task input (text generation, embeddings, classification, "
        "reranking). "
        "With `?queueRequest=true` (or `queueRequest`/`options.queueRequest` in the body), "
        "`requests` is a batch of such inputs, answered at once with a `request_id`; a body "
        '`{"request_id": ...}` polls it: its status while it runs, then every item\'s '
        "response. `model` is an id or an alias; aliases contain `/`."
    ),
    body=AnyOf(
        (
            TextGenerationInput,
            EmbeddingInput,
            ClassificationInput,
            RerankInput,
            QueuedBatch,
            PollRequest,
        )
    ),
    query=(Field("queueRequest", {"type": "boolean"}, "Queue the body's `requests`."),),
    headers=CACHE_HEADERS,
    answers=(
        Answer(
            200,
            ENVELOPE,
            "The result; with `stream: true` (text generation), server-sent events.",
            also=("text/event-stream",),
            links={
                "poll": Link(
                    operation_id="run_model",
                    description="Poll a queued batch by the `request_id` it was answered with.",
                    parameters={
                        "account_id": "$request.path.account_id",
                        "model": "$request.path.model",
                    },
                    request_body={"request_id": "$response.body#/result/request_id"},
                )
            },
        ),
    ),
    errors=(*CLIENT_ERRORS, 404, 405, *SERVER_ERROR, *BACKEND_ERRORS),
)


@post(
    "/client/v4/accounts/{account_id:str}/ai/run/{model:path}",
    opt={"auth": "key"},
    status_code=200,
    operation_class=documented(RUN_DOC),
)
async def run_model(
    request: Request[Any, Any, Any], account_id: FromPath[str], model: FromPath[str]
) -> Response[Any]:
    svc = workers_ai(request)
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await svc.run(
        model.lstrip("/"),
        body,
        ctx,
        queue_request=truthy(request.query_params.get("queueRequest")),
        directives=directives_from(request.headers),
    )
    return respond(reply, ctx)


ROUTES = [run_model]
