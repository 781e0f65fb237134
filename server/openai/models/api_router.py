"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath

from server.apidoc.operation import SERVER_ERROR, Answer, RouteDoc, documented
from server.envelope.context import record
from server.http.respond import respond
from server.openai.models.protocol import ModelCard, ModelList
from server.openai.models.serving import ModelsServing


def models(request: Request[Any, Any, Any]) -> ModelsServing:
    svc: ModelsServing = request.app.state.models
    return svc


@get(
    "/v1/models",
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="List models",
            tag="OpenAI",
            answers=(
                Answer(
                    200,
                    ModelList,
                    "Every model the gateway serves (a key scoped to some models: those).",
                ),
            ),
            errors=(401, 429, *SERVER_ERROR),
        )
    ),
)
def list_models(request: Request[Any, Any, Any]) -> Response[Any]:
    return respond(models(request).list_models(record(request).principal.models))


@get(
    "/v1/models/{model:path}",
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="Retrieve a model",
            tag="OpenAI",
            description="`model` is an id or an alias; aliases may contain `/`. A model "
            "outside an API key's scope is a 404, as one that does not exist.",
            answers=(Answer(200, ModelCard, "The model."),),
            errors=(401, 404, 429, *SERVER_ERROR),
        )
    ),
)
def get_model(request: Request[Any, Any, Any], model: FromPath[str]) -> Response[Any]:
    allowed = record(request).principal.models
    return respond(models(request).get_model(model.lstrip("/"), allowed))


ROUTES = [list_models, get_model]
