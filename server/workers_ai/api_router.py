"""The Workers-AI route: read the body, hand it to the Workers-AI serving object."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post
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
from server.envelope.context import context, record
from server.errors import ApiError
from server.http.reply import Reply
from server.http.respond import parse_body, respond
from server.identity.auth import model_allowed
from server.serving.cache_headers import directives_from
from server.serving.core import unknown_model
from server.workers_ai import catalog
from server.workers_ai.catalog import ModelEntry, ModelSchema, PageInfo
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


def _listed(request: Request[Any, Any, Any]) -> list[Any]:
    """The models this request's key may use."""
    allowed = record(request).principal.models
    models = request.app.state.registry.models.values()
    return [m for m in models if model_allowed(allowed, m.id, m)]


def _success(result: Any, **extra: Any) -> Reply:
    body = {"result": result, **extra, "success": True, "errors": [], "messages": []}
    return Reply(200, msgspec.json.encode(body))


def _envelope_of(result: Any, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["result", "success", "errors", "messages", *extra],
        "properties": {
            "result": result,
            **extra,
            "success": {"const": True},
            "errors": {"type": "array", "maxItems": 0},
            "messages": {"type": "array"},
        },
    }


SEARCH_QUERY = (
    Field("search", {"type": "string"}, "A part of a model's name, alias or description."),
    Field(
        "task",
        {"type": "string"},
        "A task's name (`Text Generation`, `Text Embeddings`, "
        "`Text Classification`) or the gateway's (`chat`, `embeddings`, ...).",
    ),
    Field("author", {"type": "string"}, "The model's owner."),
    Field("page", {"type": "integer", "minimum": 1}, "The page (from 1)."),
    Field(
        "per_page",
        {"type": "integer", "minimum": 1, "maximum": catalog.MAX_PER_PAGE},
        f"Models per page (default {catalog.DEFAULT_PER_PAGE}).",
    ),
    Field("hide_experimental", {"type": "boolean"}, "Accepted; no model here is experimental."),
    Field("include_deprecated", {"type": "boolean"}, "Accepted; no model here is deprecated."),
    Field("source", {"type": "number"}, "Accepted; every model here is of source 1."),
    Field("format", {"type": "string"}, "Not offered: a value is a 400."),
)


@get(
    "/client/v4/accounts/{account_id:str}/ai/models/search",
    opt={"auth": "key"},
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="Search models (Workers AI)",
            tag="Workers AI",
            description="The models `run` serves (a key scoped to some models: those), one "
            "entry each, named as `run` takes them, in Cloudflare's paginated envelope.",
            query=SEARCH_QUERY,
            answers=(
                Answer(
                    200,
                    _envelope_of(list[ModelEntry], result_info=PageInfo),
                    "A page of the models that match.",
                ),
            ),
            errors=(400, 401, 403, 429, *SERVER_ERROR),
        )
    ),
)
def search_models(request: Request[Any, Any, Any], account_id: FromPath[str]) -> Response[Any]:
    found, page = catalog.search(_listed(request), request.query_params)
    return respond(_success(found, result_info=page))


@get(
    "/client/v4/accounts/{account_id:str}/ai/models/schema",
    opt={"auth": "key"},
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="A model's input and output schemas (Workers AI)",
            tag="Workers AI",
            query=(Field("model", {"type": "string"}, "The model's name or id.", required=True),),
            answers=(Answer(200, _envelope_of(ModelSchema), "The model's JSON schemas."),),
            errors=(400, 401, 403, 404, 429, *SERVER_ERROR),
        )
    ),
)
def model_schema(request: Request[Any, Any, Any], account_id: FromPath[str]) -> Response[Any]:
    name = request.query_params.get("model", "")
    if not name:
        raise ApiError(400, "Name the model: `?model=`.", param="model", code="invalid_query")
    info = request.app.state.registry.resolve(name)
    if info is None or not model_allowed(record(request).principal.models, name, info):
        raise unknown_model(name)
    return respond(_success(catalog.schema(info)))


ROUTES = [run_model, search_models, model_schema]
