"""Streamed answers through the exact cache, at the serving layer with an in-process backend:
the leader's response relays and records the backend's stream, waiters share its answer, a
client that leaves stores nothing and releases the backend, a stale answer refreshes alone.

(The same behaviours against a real vLLM are in ``test_cache_http.py``, marked slow.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from backends.interfaces import BackendError, UpstreamResponse
from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from semcache.entry import CachedAnswer
from semcache.exact import CacheControl, ExactCache
from semcache.policy import PolicyHolder
from semcache.tiers import MemoryStore
from server.http.reply import Reply, aclose_stream
from server.metrics import GatewayMetrics
from server.openai.chat_completion.protocol import ChatCompletionRequest
from server.openai.text_generation import TextGenerationServing
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.generation import Generation
from tests.support.stepped_clock import SteppedClock


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    doc = {
        "id": "chatcmpl-t",
        "object": "chat.completion.chunk",
        "model": "served",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = b'data: {"id":"chatcmpl-t","object":"chat.completion.chunk","model":"served",' + (
    b'"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
)
CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "hel"}),
    _chunk({"content": "lo"}, "stop"),
    USAGE,
    b"data: [DONE]\n\n",
]


class Stream:
    def __init__(self, chunks: list[bytes], gate: asyncio.Event, fail_after: int | None) -> None:
        self.status = 200
        self.content_type = "text/event-stream"
        self._chunks = chunks
        self._gate = gate
        self._fail_after = fail_after
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, c in enumerate(self._chunks):
            if i == 1:
                await self._gate.wait()  # the first chunk, then whatever the test allows
            if self._fail_after is not None and i >= self._fail_after:
                raise BackendError("unreachable", "backend died")
            yield c

    async def read_all(self) -> bytes:
        return b"".join(self._chunks)

    async def aclose(self) -> None:
        self.closed = True


class Backend:
    name = "fake"
    served_model = "served"

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_after: int | None = None

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        raise AssertionError("streams only")

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Stream:
        await asyncio.sleep(0)
        assert body["stream_options"]["include_usage"] is True  # always asked of the backend
        stream = Stream(CHUNKS, self.gate, self.fail_after)
        self.streams.append(stream)
        return stream

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


@pytest.fixture
def backend() -> Backend:
    return Backend()


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock(1000.0)


@pytest.fixture
def serving(backend: Backend, clock: SteppedClock) -> TextGenerationServing:
    reg = ModelRegistry()
    reg.generation["fake"] = backend
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    core = ServingCore(reg, GatewayMetrics(CollectorRegistry()), PolicyHolder(None))
    memory = MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size)
    core.cache = ExactCache(memory=memory, clock=clock)
    path, schema = "/v1/chat/completions", ChatCompletionRequest
    return TextGenerationServing(core, Generation(core), path=path, route="chat", schema=schema)


def body(usage: bool = False, max_tokens: int | None = 16) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "stream": True,
    }
    if usage:
        out["stream_options"] = {"include_usage": True}
    if max_tokens is not None:  # else the shipped policy's default (256) applies
        out["max_tokens"] = max_tokens
    return out


async def ask(
    svc: TextGenerationServing,
    usage: bool = False,
    ttl: int | None = None,
    max_tokens: int | None = 16,
) -> Reply:
    directives = CacheDirectives(control=CacheControl(ttl_s=ttl))
    request = body(usage, max_tokens)
    return await svc.create(request, RequestContext(request_id="r", tenant="t"), directives)


async def read(reply: Reply) -> bytes:
    assert reply.stream is not None
    out = b"".join([chunk async for chunk in reply.stream])
    await aclose_stream(reply.stream)
    return out


async def settled(svc: TextGenerationServing) -> None:
    for _ in range(5):  # the fill stores once the relay hands it the recorded answer
        await asyncio.sleep(0)


async def test_a_miss_is_relayed_then_replayed_from_the_cache(
    serving: TextGenerationServing, backend: Backend
) -> None:
    miss = await ask(serving, usage=True)
    assert miss.headers["cf-aig-cache-status"] == "MISS"
    assert await read(miss) == b"".join(CHUNKS)  # the backend's events, as they were
    await settled(serving)
    hit = await ask(serving, usage=True)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert await read(hit) == b"".join(CHUNKS)
    assert len(backend.streams) == 1
    assert backend.streams[0].closed


async def test_the_usage_chunk_goes_only_to_clients_that_asked(
    serving: TextGenerationServing, backend: Backend
) -> None:
    miss = await ask(serving)
    expected = b"".join(c for c in CHUNKS if c != USAGE)
    assert await read(miss) == expected
    await settled(serving)
    assert await read(await ask(serving)) == expected
    assert await read(await ask(serving, usage=True)) == b"".join(CHUNKS)


async def test_the_policys_default_max_tokens_is_said_in_the_usage_chunk_and_replayed(
    serving: TextGenerationServing, backend: Backend
) -> None:
    noted = USAGE.replace(
        b'"total_tokens":7}',
        b'"total_tokens":7,"max_tokens_applied":256,"max_tokens_source":"default"}',
    )
    expected = b"".join(noted if c == USAGE else c for c in CHUNKS)
    miss = await ask(serving, usage=True, max_tokens=None)
    assert await read(miss) == expected
    await settled(serving)
    hit = await ask(serving, usage=True, max_tokens=None)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert await read(hit) == expected
    # a request that names the same value itself is another key: its usage says nothing
    named = await ask(serving, usage=True, max_tokens=256)
    assert named.headers["cf-aig-cache-status"] == "MISS"
    assert await read(named) == b"".join(CHUNKS)


async def test_a_broken_stream_ends_with_an_error_event_and_stores_nothing(
    serving: TextGenerationServing, backend: Backend
) -> None:
    backend.fail_after = 2
    out = await read(await ask(serving))
    assert out.startswith(CHUNKS[0] + CHUNKS[1])
    assert b"backend_stream_broken" in out and b"[DONE]" not in out
    backend.fail_after = None
    await settled(serving)
    assert (await ask(serving)).headers["cf-aig-cache-status"] == "MISS"


async def test_concurrent_identical_streams_make_one_backend_call(
    serving: TextGenerationServing, backend: Backend
) -> None:
    backend.gate.clear()
    leader = await ask(serving)
    assert leader.headers["cf-aig-cache-status"] == "MISS"
    waiters = [asyncio.create_task(ask(serving)) for _ in range(3)]
    relay = asyncio.create_task(read(leader))
    await settled(serving)  # loop turns: the waiters reach the leader's flight (no I/O)
    assert not any(w.done() for w in waiters)  # waiting for the leader's answer
    assert len(backend.streams) == 1
    backend.gate.set()
    expected = b"".join(c for c in CHUNKS if c != USAGE)
    assert await relay == expected
    for reply in await asyncio.gather(*waiters):
        assert await read(reply) == expected
    assert len(backend.streams) == 1


async def test_a_client_gone_mid_stream_stores_nothing_and_releases_the_backend(
    serving: TextGenerationServing, backend: Backend
) -> None:
    backend.gate.clear()
    leader = await ask(serving)
    assert leader.stream is not None
    waiter = asyncio.create_task(ask(serving))
    it = aiter(leader.stream)
    assert await anext(it) == CHUNKS[0]
    await aclose_stream(leader.stream)  # the client left
    await settled(serving)
    assert backend.streams[0].closed
    backend.gate.set()
    second = await waiter  # the waiter starts over: it leads its own backend call
    assert second.headers["cf-aig-cache-status"] == "MISS"
    await read(second)
    assert len(backend.streams) == 2


async def test_a_relay_closed_before_it_started_releases_everything(
    serving: TextGenerationServing, backend: Backend
) -> None:
    leader = await ask(serving)
    assert leader.stream is not None
    waiter = asyncio.create_task(ask(serving))
    await aclose_stream(leader.stream)  # never iterated
    assert backend.streams[0].closed
    second = await asyncio.wait_for(waiter, 5)
    assert second.headers["cf-aig-cache-status"] == "MISS"
    await read(second)


async def test_a_stale_stream_is_served_and_refreshed_once_in_the_background(
    serving: TextGenerationServing, backend: Backend, clock: SteppedClock
) -> None:
    await read(await ask(serving, ttl=10))
    await settled(serving)
    clock.now += 11  # past the TTL, within stale-while-revalidate
    stale = await ask(serving)
    assert stale.headers["cf-aig-cache-status"] == "STALE"
    await read(stale)
    assert serving.core.cache is not None
    await serving.core.cache.wait_refreshes()
    assert len(backend.streams) == 2 and backend.streams[1].closed
    fresh = await ask(serving)
    assert fresh.headers["cf-aig-cache-status"] == "HIT"
    assert fresh.headers["age"] == "0"


async def test_the_leader_opens_the_backend_stream_from_its_own_task(
    serving: TextGenerationServing, backend: Backend
) -> None:
    # No hop through another task: with many requests arriving together, each one's stream
    # is opened as it is handled rather than after every handler has run.
    opened_by: list[asyncio.Task[Any] | None] = []
    open_stream = backend.open_stream

    async def spy(path: str, body: dict[str, Any], ctx: RequestContext) -> Stream:
        opened_by.append(asyncio.current_task())
        return await open_stream(path, body, ctx)

    backend.open_stream = spy  # type: ignore[method-assign]
    reply = await ask(serving)
    assert opened_by == [asyncio.current_task()]
    assert b"hel" in await read(reply)
    await settled(serving)
    assert (await ask(serving)).headers["cf-aig-cache-status"] == "HIT"  # stored as before
