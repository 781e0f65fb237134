"""The serving core every API surface shares: the models, metrics, policy and caches; which
model a request names, whose answers it may share, and its exact-cache key (built once, here,
through ``semcache``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from backends.registry import ModelInfo, ModelRegistry, Task
from foundation.request import RequestContext
from semcache.exact import CacheRequest, CacheResult, CacheStatus, ExactCache
from semcache.policy import PolicyHolder
from semcache.semantic.service import SemanticService
from server.errors import ApiError
from server.guard.inspector import Guard
from server.identity.auth import check_model
from server.metrics import GatewayMetrics
from server.serving.cache_headers import CacheDirectives


def unknown_model(name: str) -> ApiError:
    """OpenAI's 404 for a model it does not serve (Anthropic's routes answer their
    ``not_found_error``, Workers AI's their envelope, from the same status)."""
    return ApiError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        type="invalid_request_error",
        code="model_not_found",
    )


class HitListener(Protocol):
    """What hears of the fresh exact hits the core answers (the envelope's early hits: a
    repeat of the same bytes is then answered before routing)."""

    def exact_hit(
        self, ctx: RequestContext, creq: CacheRequest, info: ModelInfo, body: Mapping[str, Any]
    ) -> None: ...


class LiveTraffic(Protocol):
    """What hears that a live request is about to reach a backend (the batch workers' gates:
    batch items running there yield, live traffic first)."""

    def live_request(self, backend: str) -> None: ...


@dataclass
class ServingCore:
    """One per gateway, built by the app factory (the caches are set at start-up)."""

    registry: ModelRegistry
    metrics: GatewayMetrics
    policy: PolicyHolder
    cache: ExactCache | None = None
    """Set at start-up (opening the tiers is async); ``None`` serves without caching."""
    semantic: SemanticService | None = None
    """The semantic cache (loaded on first use); also the classifier's encoder."""
    live: LiveTraffic | None = None
    """Told of each live request before it is sent (set at start-up when batches run)."""
    hits: HitListener | None = None
    """Told of each fresh exact hit answered (set by the app factory with early hits on)."""
    guard: Guard | None = None
    """The DLP detectors and guardrails (``server/guard``), where a rule names them."""

    def answered(
        self,
        ctx: RequestContext,
        creq: CacheRequest,
        res: CacheResult,
        info: ModelInfo,
        body: Mapping[str, Any],
    ) -> None:
        """``res`` answered ``ctx``'s request: a fresh exact hit is told to ``hits``."""
        if ctx.usage.inspected:
            return  # every repeat is inspected again: it takes the route
        if self.hits is not None and res.status is CacheStatus.HIT and not res.coalesced:
            self.hits.exact_hit(ctx, creq, info, body)

    def announce(self, backend: str, ctx: RequestContext) -> None:
        """A request is about to reach ``backend``: batch work there yields to a live one."""
        if self.live is not None and not ctx.background:
            self.live.live_request(backend)

    def resolve(self, name: str, task: Task, ctx: RequestContext | None = None) -> ModelInfo:
        """The model ``name`` (an id or alias) serving ``task``; a 404 or 400 otherwise, a
        403 when the request's API key may not use it."""
        info = self.registry.resolve(name)
        if info is None:
            raise unknown_model(name)
        if ctx is not None:
            check_model(ctx.models, name, info)
        if info.task != task:
            raise ApiError(
                400,
                f"The model `{name}` serves {info.task}, not {task}.",
                param="model",
                code="model_task_mismatch",
            )
        return info

    def scope(self, info: ModelInfo, route: str, ctx: RequestContext) -> str:
        """Whose answers the request may share (the exact cache's key scope, the semantic
        partition's, and vLLM's ``cache_salt``): see ``semcache.policy.Policy.scope``."""
        policy = self.policy.current
        return policy.scope(policy.rule(info.id, route), ctx.tenant, ctx.token_id)

    async def cache_request(
        self,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None,
        guard_version: str = "",
    ) -> CacheRequest | None:
        """The request as the exact cache sees it; ``None`` when it goes uncached.
        ``guard_version``: the inspection rules that applied, part of the key as the
        model's revision is (a change of rules re-checks every answer)."""
        if self.cache is None or directives is None:
            return None
        return await self.cache.prepare(
            route=route,
            body=body,
            model_id=info.id,
            revision=f"{info.revision}+guard.{guard_version}" if guard_version else info.revision,
            rule=self.policy.current.rule(info.id, route),
            tenant=ctx.tenant,
            scope=self.scope(info, route, ctx),
            control=directives.control,
            tags=directives.tags,
            chat_template_fp=info.chat_template_fp,
            custom_key=directives.custom_key,
            sampling_defaults=info.sampling_defaults,
        )
