"""The Workers AI surface: Cloudflare's REST API on ``/client/v4``, in its envelope."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from server.surface import Services, Surface
from server.workers_ai import api_router
from server.workers_ai.errors import WORKERS_AI_ERRORS
from server.workers_ai.serving import WorkersAIServing


def build(services: Services) -> Mapping[str, Any]:
    serving = WorkersAIServing(
        services.core, services.generation, services.pooling, services.batch_system
    )
    services.batch_system.register(serving)  # the items a Workers AI batch queued
    return {"workers_ai": serving}


SURFACE: Final = Surface(
    name="Workers AI",
    prefixes=("/client/v4",),
    routes=tuple(api_router.ROUTES),
    errors=WORKERS_AI_ERRORS,
    build=build,
)
