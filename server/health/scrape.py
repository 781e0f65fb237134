"""``GET /metrics``: the gateway's Prometheus metrics (``server/metrics.py`` holds them)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.apidoc.operation import Answer, RouteDoc, documented


@get(
    "/metrics",
    opt={"auth": "public"},
    sync_to_thread=False,
    operation_class=documented(
        RouteDoc(
            summary="Prometheus metrics",
            tag="Health",
            auth=False,
            answers=(
                Answer(
                    200,
                    {"type": "string"},
                    "The Prometheus text format.",
                    media_type="text/plain",
                ),
            ),
            errors=(),
        )
    ),
)
def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


ROUTES = [metrics]
