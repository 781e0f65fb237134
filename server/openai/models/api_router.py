"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath

from server.openai.routing import respond, serving


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request[Any, Any, Any]) -> Response[Any]:
    return respond(serving(request).models.list_models())


@get("/v1/models/{model:path}", sync_to_thread=False)
def get_model(request: Request[Any, Any, Any], model: FromPath[str]) -> Response[Any]:
    return respond(serving(request).models.get_model(model.lstrip("/")))


ROUTES = [list_models, get_model]
