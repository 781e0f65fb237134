"""The application factory: builds every dependency; importing this module does no work."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from backends.fleet.pool_metrics import BackendCollector
from backends.registry import ModelRegistry, ModelSpec, build_registry
from foundation.clock import AdjustableClock
from semcache.exact import open_exact_cache
from semcache.ledger import open_ledger
from semcache.policy import PolicyError, PolicyHolder
from semcache.semantic.service import SemanticService
from server.apidoc.document import docs_router, openapi_config
from server.batch.system import BatchSystem
from server.config import GatewayConfig
from server.encoders import load_encoder
from server.envelope.early_hits import EarlyHits
from server.envelope.middleware import Envelope, envelope_middleware
from server.envelope.queue_tickets import Tickets
from server.envelope.request_log import RequestLog
from server.errors import exception_handler
from server.guard.guardrails import Scorer
from server.guard.inspector import Guard
from server.guard.metrics import GuardMetrics
from server.http.draining import Drain
from server.http.head import head_as_get
from server.http.internals import before_routing, write_bodies_eagerly
from server.identity.admin_token import admin_token
from server.identity.api_keys.admin import KeyAdmin
from server.identity.api_keys.factory import build_key_view
from server.identity.auth import TokenAuth
from server.limits.limiter import build_limiter
from server.metrics import GatewayMetrics
from server.pools.factory import build_membership
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.pooling import Pooling
from server.serving.tokenization import Tokenization
from server.surface import Services, Surface, Surfaces
from server.surfaces import builtin_surfaces
from server.telemetry import build_tracing

log = logging.getLogger("semcache.server")


def registry_from_config(config: GatewayConfig) -> ModelRegistry:
    specs = [
        ModelSpec(m.id, m.backend, m.task, tuple(m.aliases), m.owned_by) for m in config.models
    ]
    return build_registry(
        specs,
        config.backends,
        config.data_path(),
        created=int(time.time()),
        encoder_dir=config.encoder_path(),
    )


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


def create_app(
    config: GatewayConfig,
    registry: ModelRegistry | None = None,
    *,
    span_exporter: SpanExporter | None = None,
    clock: Callable[[], float] = time.time,
    surfaces: list[Surface] | None = None,
) -> Litestar:
    """Build the gateway app for ``config``; backend clients are made here, models load at start.

    ``span_exporter`` (tests) turns tracing on, every span handed to it as it ends. ``clock``
    is the wall clock of calendar days and months: the usage ledger's days, the budgets'
    periods, the request records' times (tests set it; rate windows keep the storage's own
    clock). With ``[debug] adjustable_clock`` it is wrapped in one an admin can move, and the
    answer cache reads it too. ``surfaces``: the API surfaces served (``server/surfaces.py``:
    the built-in ones ``config`` turns on).
    """
    served = Surfaces(surfaces if surfaces is not None else builtin_surfaces(config))
    adjustable = AdjustableClock(clock) if config.debug.adjustable_clock else None
    if adjustable is not None:
        log.warning("[debug] adjustable_clock is on: an admin can move this gateway's clock")
        clock = adjustable
    registry = registry or registry_from_config(config)
    tracing = build_tracing(config.tracing, exporter=span_exporter)
    metrics = GatewayMetrics(CollectorRegistry())
    # the vLLM servers: in-flight, health, errors, P/D hops, hand-off latency, their own counters
    metrics.registry.register(BackendCollector(registry.generation.values()))
    policy = PolicyHolder(config.policy)  # invalid → PolicyError: the server refuses to start
    core = ServingCore(registry, metrics, policy)
    generation = Generation(core)
    pooling_core = Pooling(core, generation)
    tokens = Tokenization(core)
    # Built now, loaded on first use: the semantic cache and the classifiers' encoder.
    tiers = policy.current.tiers
    core.semantic = SemanticService(
        directory=config.data_path() / tiers.semantic.dir if config.cache else None,
        redis_url=tiers.redis.url if config.cache else None,
        redis_prefix=tiers.redis.prefix,
        max_bytes=tiers.semantic.max_bytes,
        snapshot_interval_s=tiers.semantic.snapshot_interval_s,
        encoder_factory=partial(load_encoder, graph_dir=config.encoder_path()),
        registry=metrics.registry,
    )

    core.guard = guard = Guard(
        GuardMetrics(metrics.registry), Scorer(registry, core.semantic.encoder)
    )
    if (problem := guard.check_models(policy.current)) is not None:
        raise PolicyError(problem)  # a guardrail names no classifier: refuse to start

    key_view = build_key_view(
        config.keys,
        data_dir=config.data_path(),
        redis_url=tiers.redis.url,
        redis_prefix=tiers.redis.prefix,
    )
    membership = build_membership(
        config.pools,
        registry,
        data_dir=config.data_path(),
        redis_url=tiers.redis.url,
        redis_prefix=tiers.redis.prefix,
    )
    auth = TokenAuth(config.auth, admin_token=admin_token(config.auth.admin, policy), keys=key_view)
    request_log = (
        RequestLog(config.request_log, config.data_path()) if config.request_log.enabled else None
    )
    ledger = open_ledger(
        config.ledger,
        data_dir=config.data_path(),
        redis_url=tiers.redis.url,
        redis_prefix=tiers.redis.prefix,
        clock=clock,
    )
    limiter = build_limiter(
        config.limits,
        [t.limits for t in config.auth.tokens],
        redis_url=tiers.redis.url,
        redis_prefix=tiers.redis.prefix,
        spent=ledger.spent,
        calendar=clock,
        overrides_later=key_view is not None,
        redis_timeout_s=tiers.redis.timeout_s,
    )
    key_admin = (
        KeyAdmin(
            key_view,
            defaults=config.limits,
            config_tokens=auth.config_token_ids,
            limiter=limiter,
            served=lambda name: registry.resolve(name) is not None,
        )
        if key_view is not None
        else None
    )
    tickets = Tickets(config.queue)
    drain = Drain()  # SIGTERM: `semcache serve` drains (server/http/draining.py)
    envelope = Envelope(
        auth=auth,
        metrics=metrics,
        policy=policy,
        drain=drain,
        request_log=request_log,
        ledger=ledger if config.ledger.enabled else None,
        limiter=limiter,
        max_body_bytes=config.server.max_body_bytes,
        tracing=tracing,
        clock=clock,
        surfaces=served,
    )
    batch_system = BatchSystem(
        config.batch,
        config.data_path(),
        registry,
        metrics.registry,
        accounting=envelope.finish_item,
        tracing=tracing,
        tickets=tickets,
    )
    services = Services(
        config=config,
        core=core,
        generation=generation,
        pooling=pooling_core,
        tokens=tokens,
        batch_system=batch_system,
        metrics=metrics,
    )
    surface_state: dict[str, Any] = {}
    for surface in served.all:
        if surface.build is not None:
            surface_state.update(surface.build(services))

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        write_bodies_eagerly(asyncio.get_running_loop())  # before any backend session opens
        if request_log is not None:
            request_log.start()
        await ledger.start()
        if key_view is not None:
            await key_view.start()
        if membership is not None:  # the pools as run-time changes left them
            await membership.start()
        await registry.check_revisions()  # models versioned by what their servers report
        for backend in registry.embedding.values():
            await backend.start()
        for classifier in registry.classifiers.values():
            if not classifier.uses_encoder:  # vLLM classifiers: their tokenizer
                await classifier.start()
        if config.cache:
            core.cache = await open_exact_cache(
                policy.current.tiers,
                data_dir=config.data_path(),
                registry=metrics.registry,
                clock=adjustable,  # None: the system's clock
            )
        reload_on_sighup(policy)
        await guard.warm(policy.current)  # the detectors a rule names, built off the loop
        if core.semantic is not None and core.semantic.redis_url and semantic_used(policy):
            # Subscribe to the other gateways' entries now, not at the first request.
            core.semantic.warm()
        await batch_system.start()
        if batch_system.enabled:  # live requests: batch work on their backend yields
            core.live = batch_system
        try:
            async with AsyncExitStack() as running:  # the surfaces' background tasks
                for surface in served.all:
                    if surface.lifespan is not None:
                        await running.enter_async_context(surface.lifespan(surface_state))
                yield
        finally:
            core.live = None
            await batch_system.aclose()  # batch workers stop before the cache closes
            if core.semantic is not None:
                await core.semantic.aclose()
            if core.cache is not None:
                await core.cache.aclose()
                core.cache = None
            if membership is not None:  # before the pools close: no change lands after
                await membership.aclose()
            await registry.aclose()
            await ledger.aclose()  # after the batch workers: every usage is written
            for surface in served.all:  # what they stored (after the batch workers)
                if surface.close is not None:
                    await surface.close(surface_state)
            if request_log is not None:
                request_log.stop()
            if limiter is not None:
                await limiter.aclose()
            if tracing is not None:
                await asyncio.to_thread(tracing.close)  # the spans still queued are sent
            if key_view is not None:
                await key_view.aclose()

    app = Litestar(
        route_handlers=[*served.routes(), docs_router()],
        state=State(
            {
                "registry": registry,
                "metrics": metrics,
                "core": core,
                **surface_state,
                "batch_system": batch_system,
                "config": config,
                "policy": policy,
                "auth": auth,
                "envelope": envelope,
                "queue_tickets": tickets,
                "drain": drain,
                "ledger": ledger,
                "tracing": tracing,
                "api_keys": key_admin,
                "membership": membership,
                "clock": adjustable,
            }
        ),
        middleware=[envelope_middleware(envelope)],
        exception_handlers={Exception: exception_handler(served.errors_of)},
        template_config=next((s.templates for s in served.all if s.templates), None),
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=openapi_config(served),
        logging_config=None,
    )
    if config.server.early_hits:
        early = EarlyHits(core, envelope, served.early_hits)
        before_routing(app, early.wrap)
        core.hits = early
    before_routing(app, head_as_get)  # outermost: every layer after it sees a GET
    return app
