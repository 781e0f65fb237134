"""The application factory: builds every dependency; importing this module does no work."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from litestar import Litestar
from litestar.datastructures import State
from prometheus_client import CollectorRegistry

from backends.registry import ModelRegistry, ModelSpec, build_registry
from semcache.exact import open_exact_cache
from semcache.policy import PolicyHolder
from semcache.semantic.encoder import load_encoder
from semcache.semantic.service import SemanticService
from server.config import GatewayConfig
from server.errors import handle_exception
from server.metrics import GatewayMetrics
from server.openai.chat_completion import api_router as chat_completion
from server.openai.completion import api_router as completion
from server.openai.models import api_router as models
from server.openai.pooling import api_router as pooling
from server.openai.serving import OpenAIServing
from server.routes import admin, cached_answer, health
from server.speedups import write_bodies_eagerly
from server.workers_ai import api_router as workers_ai_routes
from server.workers_ai.serving import open_workers_ai

log = logging.getLogger("semcache.server")


def registry_from_config(config: GatewayConfig) -> ModelRegistry:
    specs = [
        ModelSpec(m.id, m.backend, m.task, tuple(m.aliases), m.owned_by) for m in config.models
    ]
    return build_registry(specs, config.backends, config.data_path(), created=int(time.time()))


def reload_on_sighup(policy: PolicyHolder) -> None:
    """SIGHUP reloads the policy file; an invalid file keeps the current policy."""

    def reload() -> None:
        error = policy.reload()
        if error is None:
            log.warning("policy reloaded")
        else:
            log.error("policy reload failed, keeping the current policy: %s", error)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread (tests) or no signals on this platform


def semantic_used(policy: PolicyHolder) -> bool:
    """Whether any rule of the current policy turns the semantic cache on."""
    current = policy.current
    rules = [current.defaults, *current.route_rules.values(), *current.model_rules.values()]
    return any(rule.semantic.enabled for rule in rules)


def create_app(config: GatewayConfig, registry: ModelRegistry | None = None) -> Litestar:
    """Build the gateway app for ``config``; backend clients are made here, models load at start."""
    registry = registry or registry_from_config(config)
    metrics = GatewayMetrics(CollectorRegistry())
    policy = PolicyHolder(config.policy)  # invalid → PolicyError: the server refuses to start
    serving = OpenAIServing(registry, metrics, policy)
    # Built now, loaded on first use: the semantic cache and the classifiers' encoder.
    tiers = policy.current.tiers
    serving.semantic = SemanticService(
        directory=config.data_path() / tiers.semantic.dir if config.cache else None,
        redis_url=tiers.redis.url if config.cache else None,
        redis_prefix=tiers.redis.prefix,
        max_bytes=tiers.semantic.max_bytes,
        snapshot_interval_s=tiers.semantic.snapshot_interval_s,
        encoder_factory=partial(load_encoder, graph_dir=config.data_path() / "encoders"),
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        write_bodies_eagerly(asyncio.get_running_loop())  # before any backend session opens
        for backend in registry.embedding.values():
            await backend.start()
        for classifier in registry.classifiers.values():
            if not classifier.uses_encoder:  # vLLM classifiers: their tokenizer
                await classifier.start()
        if config.cache:
            serving.cache = await open_exact_cache(
                policy.current.tiers, data_dir=config.data_path(), registry=metrics.registry
            )
        reload_on_sighup(policy)
        if serving.semantic is not None and serving.semantic.redis_url and semantic_used(policy):
            # Subscribe to the other gateways' entries now, not at the first request.
            serving.semantic.warm()
        app.state.workers_ai = await open_workers_ai(config, serving, registry, metrics.registry)
        try:
            yield
        finally:
            await app.state.workers_ai.aclose()  # batch workers stop before the cache closes
            if serving.semantic is not None:
                await serving.semantic.aclose()
            if serving.cache is not None:
                await serving.cache.aclose()
                serving.cache = None
            await registry.aclose()

    return Litestar(
        route_handlers=[
            *models.ROUTES,
            *chat_completion.ROUTES,
            *completion.ROUTES,
            *pooling.ROUTES,
            *health.ROUTES,
            *admin.ROUTES,
            *cached_answer.ROUTES,
            *workers_ai_routes.ROUTES,
        ],
        state=State(
            {
                "registry": registry,
                "metrics": metrics,
                "serving": serving,
                "config": config,
                "policy": policy,
            }
        ),
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )
