"""The application factory: builds every dependency; importing this module does no work."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from prometheus_client import CollectorRegistry

from backends.registry import ModelRegistry, ModelSpec, build_registry
from server.config import GatewayConfig
from server.errors import handle_exception
from server.metrics import GatewayMetrics
from server.routes import health, openai
from server.serving import OpenAIServing


def registry_from_config(config: GatewayConfig) -> ModelRegistry:
    specs = [
        ModelSpec(m.id, m.backend, m.task, tuple(m.aliases), m.owned_by) for m in config.models
    ]
    return build_registry(specs, config.backends, config.data_path(), created=int(time.time()))


def create_app(config: GatewayConfig, registry: ModelRegistry | None = None) -> Litestar:
    """Build the gateway app for ``config``; backend clients are made here, models load at start."""
    registry = registry or registry_from_config(config)
    metrics = GatewayMetrics(CollectorRegistry())
    serving = OpenAIServing(registry, metrics)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        for backend in registry.embedding.values():
            await backend.start()
        try:
            yield
        finally:
            await registry.aclose()

    return Litestar(
        route_handlers=[*openai.ROUTES, *health.ROUTES],
        state=State(
            {"registry": registry, "metrics": metrics, "serving": serving, "config": config}
        ),
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )


logging.getLogger("semcache").addHandler(logging.NullHandler())
