"""Live ``/v1`` requests announce themselves to the batch gates before reaching a backend
(sync first); batch items, and answers served from the cache, do not."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from harness.fake_vllm import FakeGeneration
from semcache.entry import CachedAnswer
from semcache.exact import ExactCache
from semcache.policy import PolicyHolder
from semcache.tiers.memory import MemoryStore
from server.metrics import GatewayMetrics
from server.openai.chat_completion.protocol import ChatCompletionRequest
from server.openai.text_generation import TextGenerationServing
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.generation import Generation


def body(stream: bool) -> dict[str, Any]:
    return {
        "model": "chat-model",
        "messages": [{"role": "user", "content": f"hi {stream}"}],
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_live_requests_announce_their_backend_batch_items_do_not(
    cached: bool, stream: bool
) -> None:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    core = ServingCore(reg, GatewayMetrics(CollectorRegistry()), PolicyHolder(None))
    chat = TextGenerationServing(
        core,
        Generation(core),
        path="/v1/chat/completions",
        route="chat",
        schema=ChatCompletionRequest,
    )
    if cached:
        core.cache = ExactCache(
            memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size)
        )
    announced: list[str] = []

    class Gates:
        def live_request(self, backend: str) -> None:
            announced.append(backend)

    core.live = Gates()
    directives = CacheDirectives() if cached else None

    async def call(ctx: RequestContext) -> None:
        reply = await chat.create(body(stream), ctx, directives)
        if reply.stream is not None:
            async for _ in reply.stream:
                pass

    await call(RequestContext(request_id="item", background=True))
    assert announced == []
    await call(RequestContext(request_id="live"))
    # a cached answer (the batch item filled the cache) never reaches the backend
    assert announced == ([] if cached else ["fake"])
    await call(RequestContext(request_id="live2", session_affinity=None))
    assert len(announced) == (0 if cached else 2)
