"""The root, liveness and readiness."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Request, Response, get

from backends.registry import ModelRegistry
from server.apidoc.operation import Answer, RouteDoc, documented


class Health(msgspec.Struct):
    status: Literal["ok"] = "ok"


class Root(msgspec.Struct, kw_only=True):
    """What a client probing the base URL learns (Claude Code sends ``HEAD /`` at start)."""

    name: Literal["semcache"] = "semcache"
    status: Literal["ok"] = "ok"
    openapi: str = "/openapi.json"
    health: str = "/health"


class Readiness(msgspec.Struct, kw_only=True):
    status: Literal["ready", "not_ready"]
    backends: dict[str, bool]
    """Each backend: whether it answers."""


@get(
    "/",
    opt={"auth": "public"},
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="The gateway's root",
            tag="Health",
            auth=False,
            answers=(Answer(200, Root, "The gateway is up; where its API is described."),),
            errors=(),
        )
    ),
)
def root() -> Response[bytes]:
    return Response(msgspec.json.encode(Root()), media_type="application/json")


@get(
    "/health",
    opt={"auth": "public"},
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="Liveness",
            tag="Health",
            auth=False,
            answers=(Answer(200, Health, "The gateway is up."),),
            errors=(),
        )
    ),
)
def health() -> Response[bytes]:
    return Response(msgspec.json.encode(Health()), media_type="application/json")


@get(
    "/ready",
    opt={"auth": "public"},
    operation_class=documented(
        RouteDoc(
            summary="Readiness",
            tag="Health",
            auth=False,
            answers=(
                Answer(200, Readiness, "Every backend answers."),
                Answer(503, Readiness, "Some backend does not answer."),
            ),
            errors=(500,),
        )
    ),
)
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    registry: ModelRegistry = request.app.state.registry
    status: dict[str, bool] = {}
    for name, g in registry.generation.items():
        status[name] = await g.ready()
    for name, e in registry.embedding.items():
        status[name] = await e.ready()
    ok = all(status.values())
    body = msgspec.json.encode(Readiness(status="ready" if ok else "not_ready", backends=status))
    return Response(body, status_code=200 if ok else 503, media_type="application/json")


ROUTES = [root, health, ready]
