"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import orjson
from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.registry import ModelRegistry


@get("/health", sync_to_thread=False, opt={"auth": "public"})
def health() -> Response[bytes]:
    return Response(b'{"status":"ok"}', media_type="application/json")


@get("/ready", opt={"auth": "public"})
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    registry: ModelRegistry = request.app.state.registry
    status: dict[str, bool] = {}
    for name, g in registry.generation.items():
        status[name] = await g.ready()
    for name, e in registry.embedding.items():
        status[name] = await e.ready()
    ok = all(status.values())
    body = orjson.dumps({"status": "ready" if ok else "not_ready", "backends": status})
    return Response(body, status_code=200 if ok else 503, media_type="application/json")


@get("/metrics", sync_to_thread=False, opt={"auth": "public"})
def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


ROUTES = [health, ready, metrics]
