"""The P/D flow's rules without vLLM: what each hop is sent, retries, fallbacks, failures.

The servers here are httpx mock transports that record what they receive and answer like
vLLM (or fail like a dead one): these tests pin the decisions (which hop, which body, when to
retry). That the hops really move KV and give a monolithic server's answer is proven against
real vLLM in ``test_pd_gateway.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from backends.config import VllmBackend, VllmServer
from backends.protocol import BackendError, RequestContext
from backends.salt import CacheSalter
from backends.vllm import VllmClient

PREFILL, DECODE_1, DECODE_2 = "http://p:1", "http://d:1", "http://d:2"
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
LONG = "The cat reads a book near the window. " * 40
CHAT = "/v1/chat/completions"


@dataclass
class Upstream:
    """Fake servers by base URL: each answers with ``behaviour[url](request)``."""

    behaviour: dict[str, Callable[[httpx.Request], httpx.Response]]
    seen: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    """Servers that refuse every connection, health checks included."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = orjson.loads(request.content)
        self.seen.append((base, body, request.headers.get("x-request-id", "")))
        return self.behaviour[base](request)

    def bodies(self, base: str) -> list[dict[str, Any]]:
        return [body for url, body, _ in self.seen if url == base]


async def events(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def prefill_ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [], "kv_transfer_params": PARAMS})


def decode_ok(request: httpx.Request) -> httpx.Response:
    body = orjson.loads(request.content)
    if body.get("stream"):
        content = events(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n', b"data: [DONE]\n\n")
        return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={"choices": [{"message": {"content": "Hi"}}]})


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def client(
    upstream: Upstream, decode: tuple[str, ...] = (DECODE_1,), **settings: Any
) -> VllmClient:
    servers = [VllmServer(url=PREFILL, role="prefill")]
    servers += [VllmServer(url=u, role="decode") for u in decode]
    settings = {"health_interval_s": 3600, **settings}  # the tests drive ejection themselves
    config = VllmBackend(
        name="t", served_model="m", servers=servers, prefill_threshold_tokens=64, **settings
    )
    return VllmClient(config, CacheSalter(b"k"), transport=httpx.MockTransport(upstream))


def ctx(**fields: Any) -> RequestContext:
    return RequestContext(request_id="req-1", tenant="key:a", salt_scope="key:a", **fields)


def chat(content: str = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def test_prefill_then_decode_with_the_prefill_kv_params_and_one_request_id() -> None:
    up = Upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = client(up)
    body = chat(
        stream=True,
        max_tokens=50,
        max_completion_tokens=50,
        min_tokens=3,
        stream_options={"include_usage": True},
        kv_transfer_params={"do_remote_prefill": True, "remote_host": "evil"},
        cache_salt="chosen-by-the-client",
    )
    stream = await c.open_stream(CHAT, body, ctx())
    assert b"".join([chunk async for chunk in stream.chunks()]).endswith(b"[DONE]\n\n")
    [prefill] = up.bodies(PREFILL)
    [decode] = up.bodies(DECODE_1)
    salt = CacheSalter(b"k").salt("key:a")
    assert prefill == {
        "model": "m",
        "messages": body["messages"],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
        "cache_salt": salt,
    }
    assert decode == {
        **{k: v for k, v in body.items() if k != "cache_salt"},
        "kv_transfer_params": PARAMS,
        "cache_salt": salt,
    }
    assert [rid for _, _, rid in up.seen] == ["req-1", "req-1"]
    assert c.stats.hops == {"prefill": 1, "decode": 1}
    assert c.stats.handoff_seconds.counts[-1] + sum(c.stats.handoff_seconds.counts[:-1]) == 1
    assert c.inflight() == 0
    await c.aclose()


async def test_short_prompts_and_parallel_sampling_go_to_decode_alone() -> None:
    up = Upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = client(up)
    assert (await c.post(CHAT, chat("Hello there"), ctx())).status == 200
    assert (await c.post(CHAT, chat(n=2), ctx())).status == 200
    assert up.bodies(PREFILL) == []
    assert all("kv_transfer_params" not in b for b in up.bodies(DECODE_1))
    assert c.stats.prefill_skipped == {"short_prompt": 1, "unsupported": 1}
    await c.aclose()


async def test_prefill_down_means_decode_alone_and_the_server_is_ejected() -> None:
    up = Upstream({PREFILL: refused, DECODE_1: decode_ok})
    c = client(up)
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    assert "kv_transfer_params" not in up.bodies(DECODE_1)[0]
    assert c.prefill_pool is not None and not c.prefill_pool.servers[0].healthy
    assert (await c.post(CHAT, chat(), ctx())).status == 200  # no second try on it
    assert len(up.bodies(PREFILL)) == 1
    assert c.stats.prefill_skipped == {"prefill_down": 2}
    await c.aclose()


async def test_a_prefill_error_answer_leaves_the_answer_to_decode() -> None:
    up = Upstream({PREFILL: lambda r: httpx.Response(400, json={}), DECODE_1: decode_ok})
    c = client(up)
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    assert c.stats.prefill_skipped == {"prefill_rejected": 1}
    await c.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unreachable_decode_server_is_replaced_with_the_same_kv_params(
    stream: bool,
) -> None:
    up = Upstream({PREFILL: prefill_ok, DECODE_1: refused, DECODE_2: decode_ok})
    c = client(up, decode=(DECODE_1, DECODE_2))
    order = [s.url for s in c.router.placement.rank(c.decode_pool.servers, _key(c))]
    if order[0] != DECODE_1:  # make the dead server the first choice
        up.behaviour[DECODE_1], up.behaviour[DECODE_2] = decode_ok, refused
    first, second = order
    request = chat(stream=stream)
    if stream:
        answer = await c.open_stream(CHAT, request, ctx(session_affinity="s"))
        assert b"[DONE]" in await answer.read_all()
    else:
        assert (await c.post(CHAT, request, ctx(session_affinity="s"))).status == 200
    assert up.bodies(second)[0]["kv_transfer_params"] == PARAMS
    assert len(up.bodies(first)) == 1
    dead = next(s for s in c.decode_pool.servers if s.url == first)
    assert not dead.healthy and dead.errors["unreachable"] == 1
    assert c.stats.hops["decode_retry"] == 1
    await c.aclose()


def _key(c: VllmClient) -> Any:
    return c.router.plan(CHAT, chat(), ctx(session_affinity="s")).key


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_error_before_the_first_byte_is_retried_without_kv_params(
    stream: bool,
) -> None:
    calls = []

    def kv_pull_fails_once(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            if stream:
                error = b'data: {"error":{"message":"Internal server error","code":500}}\n\n'
                return httpx.Response(200, content=events(error, b"data: [DONE]\n\n"))
            return httpx.Response(500, json={"error": {"code": 500}})
        return decode_ok(request)

    up = Upstream({PREFILL: prefill_ok, DECODE_1: kv_pull_fails_once})
    c = client(up)
    request = chat(stream=stream)
    if stream:
        answer = await c.open_stream(CHAT, request, ctx())
        assert b"error" not in await answer.read_all()
    else:
        assert (await c.post(CHAT, request, ctx())).status == 200
    first, second = up.bodies(DECODE_1)
    assert first["kv_transfer_params"] == PARAMS
    assert "kv_transfer_params" not in second  # recompute rather than pull again
    assert c.decode_pool.servers[0].healthy
    await c.aclose()


async def test_a_client_error_is_relayed_not_retried() -> None:
    up = Upstream(
        {PREFILL: prefill_ok, DECODE_1: lambda r: httpx.Response(400, json={"error": "bad"})}
    )
    c = client(up)
    answer = await c.open_stream(CHAT, chat("hi", stream=True), ctx())
    assert answer.status == 400
    assert orjson.loads(await answer.read_all()) == {"error": "bad"}
    assert len(up.bodies(DECODE_1)) == 1
    assert c.inflight() == 0
    await c.aclose()


async def test_a_stream_broken_after_the_first_bytes_raises_and_frees_the_slot() -> None:
    async def cut() -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        raise httpx.ReadError("connection reset")

    up = Upstream({PREFILL: prefill_ok, DECODE_1: lambda r: httpx.Response(200, content=cut())})
    c = client(up)
    answer = await c.open_stream(CHAT, chat(stream=True), ctx())
    received = []
    with pytest.raises(BackendError) as broken:
        async for chunk in answer.chunks():
            received.append(chunk)
    assert len(received) == 1 and broken.value.kind == "unreachable"
    assert c.inflight() == 0
    assert not c.decode_pool.servers[0].healthy  # ejected until a health check passes
    await c.aclose()


async def test_every_decode_server_down_is_unavailable_then_readmitted() -> None:
    up = Upstream({PREFILL: prefill_ok, DECODE_1: decode_ok}, down={DECODE_1})
    c = client(up, health_interval_s=7)
    with pytest.raises(BackendError) as first:
        await c.post(CHAT, chat(), ctx())
    assert first.value.kind == "unreachable"  # tried, failed, nothing else to try
    with pytest.raises(BackendError) as then:
        await c.post(CHAT, chat(), ctx())
    assert then.value.kind == "unavailable" and then.value.retry_after_s == 7
    assert not await c.ready()
    up.down.clear()  # the server is back: the next health check re-admits it
    assert await c.ready()
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    await c.aclose()
