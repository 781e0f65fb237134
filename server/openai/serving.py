"""``OpenAIServing``: the ``/v1`` surface as the app injects it, each endpoint family's
serving object over one shared state. The routes call the families; other surfaces (Workers
AI, the admin API) and in-process callers use the shortcuts below."""

from __future__ import annotations

from typing import Any

from backends.protocol import RequestContext
from backends.registry import ModelRegistry
from semcache.exact import ExactCache
from semcache.policy import PolicyHolder
from semcache.semantic.service import SemanticService
from server.metrics import GatewayMetrics
from server.openai.chat_completion.serving import ChatCompletionServing
from server.openai.completion.serving import CompletionServing
from server.openai.models.serving import ModelsServing
from server.openai.pooling.serving import PoolingServing
from server.openai.responses.serving import ResponsesServing
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingState
from server.serving.generation import Generation
from server.serving.reply import Reply


class OpenAIServing:
    """Chat completions, completions, responses, embeddings, classification and models."""

    def __init__(
        self,
        registry: ModelRegistry,
        metrics: GatewayMetrics,
        policy: PolicyHolder,
        cache: ExactCache | None = None,
        semantic: SemanticService | None = None,
    ) -> None:
        self.state = ServingState(registry, metrics, policy, cache, semantic)
        generation = Generation(self.state)
        self.models = ModelsServing(registry)
        self.chat_completion = ChatCompletionServing(self.state, generation)
        self.completion = CompletionServing(self.state, generation)
        self.pooling = PoolingServing(self.state, generation)
        self.responses = ResponsesServing(self.state, generation)

    @property
    def cache(self) -> ExactCache | None:
        """Set at start-up (opening the tiers is async); ``None`` serves without caching."""
        return self.state.cache

    @cache.setter
    def cache(self, cache: ExactCache | None) -> None:
        self.state.cache = cache

    @property
    def semantic(self) -> SemanticService | None:
        """The semantic cache (loaded on first use); also the classifier's encoder."""
        return self.state.semantic

    @semantic.setter
    def semantic(self, semantic: SemanticService | None) -> None:
        self.state.semantic = semantic

    async def chat(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        return await self.chat_completion.create(body, ctx, cache)

    async def completions(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        return await self.completion.create(body, ctx, cache)

    async def embeddings(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        return await self.pooling.embeddings(body, ctx, cache)

    async def classify(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        return await self.pooling.classify(body, ctx, cache)
