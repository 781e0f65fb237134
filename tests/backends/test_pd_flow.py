"""The P/D flow's rules without vLLM: what each hop is sent, retries, fallbacks, failures.

The servers here are local HTTP servers (``harness.fake_vllm``) that record what
they receive and answer like vLLM, or are down (connections refused) like a dead one: these
tests pin the decisions (which hop, which body, when to retry). That the hops really move KV
and give a monolithic server's answer is proven against real vLLM in ``test_pd_gateway.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import orjson
import pytest
from aiohttp import web

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.pool_metrics import histogram_totals
from backends.fleet.salt import CacheSalter
from backends.interfaces import BackendError
from backends.vllm.client import VllmClient
from foundation.request import RequestContext
from harness.fake_vllm import FakeServer, sse

PREFILL, DECODE_1, DECODE_2 = "prefill", "decode-1", "decode-2"
"""The fake servers' names (each listens on its own port: ``Upstream.url``)."""
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
LONG = "The cat reads a book near the window. " * 40
CHAT = "/v1/chat/completions"


Behaviour = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
"""How a fake server answers a request, given the request and its JSON body."""


class Upstream:
    """Fake vLLM servers by name: each answers with ``behaviour[name](request, body)``."""

    def __init__(self, behaviour: dict[str, Behaviour]) -> None:
        self.behaviour = dict(behaviour)
        self.seen: list[tuple[str, dict[str, Any], str]] = []
        self.servers = {name: FakeServer(self._handler(name)) for name in behaviour}

    def _handler(self, name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path == "/health":
                return web.Response(status=200)
            body = orjson.loads(await request.read())
            self.seen.append((name, body, request.headers.get("x-request-id", "")))
            return await self.behaviour[name](request, body)

        return handle

    def url(self, name: str) -> str:
        return self.servers[name].url

    def name(self, url: str) -> str:
        return next(n for n, s in self.servers.items() if s.url == url)

    async def set_down(self, name: str, down: bool = True) -> None:
        """A server that is down refuses every connection, health checks included."""
        server = self.servers[name]
        await (server.stop() if down else server.start())

    def bodies(self, name: str) -> list[dict[str, Any]]:
        return [body for n, body, _ in self.seen if n == name]


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    """Starts fake servers (all up but those named in ``down``); stops them after the test."""
    made: list[Upstream] = []

    async def make(behaviour: dict[str, Behaviour], down: Collection[str] = ()) -> Upstream:
        up = Upstream(behaviour)
        made.append(up)
        for name, server in up.servers.items():
            if name not in down:
                await server.start()
        return up

    yield make
    for up in made:
        for server in up.servers.values():
            await server.stop()


def json_answer(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


async def prefill_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    return json_answer(200, {"choices": [], "kv_transfer_params": PARAMS})


async def decode_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if body.get("stream"):
        hi = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        return await sse(request, hi, b"data: [DONE]\n\n")
    return json_answer(200, {"choices": [{"message": {"content": "Hi"}}]})


def answering(status: int, payload: Any) -> Behaviour:
    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return json_answer(status, payload)

    return answer


def client(
    upstream: Upstream, decode: tuple[str, ...] = (DECODE_1,), **settings: Any
) -> VllmClient:
    servers = [VllmServer(url=upstream.url(PREFILL), role="prefill")]
    servers += [VllmServer(url=upstream.url(name), role="decode") for name in decode]
    settings = {"health_interval_s": 3600, **settings}  # the tests drive ejection themselves
    config = VllmBackendConfig(
        name="t", served_model="m", servers=servers, prefill_threshold_tokens=64, **settings
    )
    return VllmClient(config, CacheSalter(b"k"))


Make = Callable[..., Awaitable[Upstream]]


def ctx(**fields: Any) -> RequestContext:
    return RequestContext(request_id="req-1", tenant="key:a", salt_scope="key:a", **fields)


def chat(content: str = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def test_prefill_then_decode_with_the_prefill_kv_params_and_one_request_id(
    upstream: Make,
) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
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
    assert histogram_totals(c.stats.handoff_seconds)[0] == 1
    assert c.inflight() == 0
    await c.aclose()


async def test_short_prompts_and_parallel_sampling_go_to_decode_alone(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = client(up)
    assert (await c.post(CHAT, chat("Hello there"), ctx())).status == 200
    assert (await c.post(CHAT, chat(n=2), ctx())).status == 200
    assert up.bodies(PREFILL) == []
    assert all("kv_transfer_params" not in b for b in up.bodies(DECODE_1))
    assert c.stats.prefill_skipped == {"short_prompt": 1, "unsupported": 1}
    await c.aclose()


async def test_a_responses_request_is_prefilled_for_one_token_kept_nowhere(
    upstream: Make,
) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = client(up)
    body = {"model": "m", "input": LONG, "max_output_tokens": 50, "background": False}
    assert (await c.post("/v1/responses", body, ctx())).status == 200
    [prefill] = up.bodies(PREFILL)
    [decode] = up.bodies(DECODE_1)
    assert {k: prefill[k] for k in ("stream", "max_output_tokens", "store")} == {
        "stream": False,
        "max_output_tokens": 1,
        "store": False,
    }
    assert "max_tokens" not in prefill and "background" not in prefill
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode["max_output_tokens"] == 50 and decode["kv_transfer_params"] == PARAMS
    assert "store" not in decode  # the client's choice reaches decode untouched
    # a continuation of a kept response: only the decode server can have it
    follow = {"model": "m", "input": LONG, "previous_response_id": "resp_1"}
    assert (await c.post("/v1/responses", follow, ctx())).status == 200
    assert len(up.bodies(PREFILL)) == 1
    assert c.stats.prefill_skipped == {"unsupported": 1}
    await c.aclose()


async def test_prefill_down_means_decode_alone_and_the_server_is_ejected(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok}, down={PREFILL})
    c = client(up)
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    assert "kv_transfer_params" not in up.bodies(DECODE_1)[0]
    assert c.prefill_pool is not None and not c.prefill_pool.servers[0].healthy
    assert (await c.post(CHAT, chat(), ctx())).status == 200  # no second try on it
    dead = c.prefill_pool.servers[0]
    assert dead.requests == 1 and dead.errors["unreachable"] == 1  # tried once, refused
    assert c.stats.prefill_skipped == {"prefill_down": 2}
    await c.aclose()


async def test_a_prefill_error_answer_leaves_the_answer_to_decode(upstream: Make) -> None:
    up = await upstream({PREFILL: answering(400, {}), DECODE_1: decode_ok})
    c = client(up)
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    assert c.stats.prefill_skipped == {"prefill_rejected": 1}
    await c.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unreachable_decode_server_is_replaced_with_the_same_kv_params(
    stream: bool, upstream: Make
) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok, DECODE_2: decode_ok})
    c = client(up, decode=(DECODE_1, DECODE_2))
    order = [up.name(s.url) for s in c.router.placement.rank(c.decode_pool.servers, _key(c))]
    first, second = order
    await up.set_down(first)  # the dead server is the first choice
    request = chat(stream=stream)
    if stream:
        answer = await c.open_stream(CHAT, request, ctx(session_affinity="s"))
        assert b"[DONE]" in await answer.read_all()
    else:
        assert (await c.post(CHAT, request, ctx(session_affinity="s"))).status == 200
    assert up.bodies(second)[0]["kv_transfer_params"] == PARAMS
    dead = next(s for s in c.decode_pool.servers if s.url == up.url(first))
    assert up.bodies(first) == [] and dead.requests == 1  # tried once, refused
    assert not dead.healthy and dead.errors["unreachable"] == 1
    assert c.stats.hops["decode_retry"] == 1
    await c.aclose()


def _key(c: VllmClient) -> Any:
    return c.router.plan(CHAT, chat(), ctx(session_affinity="s")).key


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_error_before_the_first_byte_is_retried_without_kv_params(
    stream: bool, upstream: Make
) -> None:
    calls = []

    async def kv_pull_fails_once(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        calls.append(1)
        if len(calls) == 1:
            if stream:
                error = b'data: {"error":{"message":"Internal server error","code":500}}\n\n'
                return await sse(request, error, b"data: [DONE]\n\n")
            return json_answer(500, {"error": {"code": 500}})
        return await decode_ok(request, body)

    up = await upstream({PREFILL: prefill_ok, DECODE_1: kv_pull_fails_once})
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


CREATED = b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n'


@pytest.mark.parametrize("shape", ["json", "stream", "responses-stream"])
async def test_a_handoff_past_the_bound_is_abandoned_and_decode_computes_the_prompt(
    shape: str, upstream: Make
) -> None:
    """A decode server that does not answer a KV pull by the bound (half the prefill's lease)
    may read blocks the prefill server already freed: its attempt is dropped, and the next one,
    on the same server, computes the prompt without the KV parameters."""
    stalled = asyncio.Event()
    released = asyncio.Event()

    async def stuck_on_the_kv_pull(
        request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "kv_transfer_params" not in body:
            if shape == "responses-stream":
                done = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
                return await sse(request, CREATED, done)
            return await decode_ok(request, body)
        if shape == "responses-stream":  # sent before the engine runs: proves nothing
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(CREATED)
        stalled.set()
        await released.wait()
        return json_answer(200, {"choices": [{"message": {"content": "from freed blocks"}}]})

    up = await upstream({PREFILL: prefill_ok, DECODE_1: stuck_on_the_kv_pull})
    c = client(up, kv_lease_s=1)  # bound: 0.5 s
    try:
        if shape == "json":
            answer = await c.post(CHAT, chat(), ctx())
            assert orjson.loads(answer.body) == {"choices": [{"message": {"content": "Hi"}}]}
        elif shape == "stream":
            stream = await c.open_stream(CHAT, chat(stream=True), ctx())
            assert b'"Hi"' in await stream.read_all()
        else:
            stream = await c.open_stream("/v1/responses", {"input": LONG, "stream": True}, ctx())
            assert b"response.completed" in await stream.read_all()
        assert stalled.is_set()
        first, second = up.bodies(DECODE_1)
        assert first["kv_transfer_params"] == PARAMS
        assert "kv_transfer_params" not in second
        kind = "json" if shape == "json" else "stream"
        assert c.stats.handoff_over_bound == {kind: 1}
        assert c.stats.hops == {"prefill": 1, "decode": 1, "decode_retry": 1}
        assert c.decode_pool.servers[0].healthy  # busy is not broken: no ejection
        assert c.inflight() == 0
    finally:
        released.set()
        await c.aclose()


async def test_a_handoff_past_the_bound_with_no_attempt_left_is_an_error(upstream: Make) -> None:
    released = asyncio.Event()

    async def stuck(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await released.wait()
        return json_answer(200, {"choices": [{"message": {"content": "from freed blocks"}}]})

    up = await upstream({PREFILL: prefill_ok, DECODE_1: stuck})
    c = client(up, kv_lease_s=1, handoff_bound_s=0.2, decode_attempts=1)
    try:
        with pytest.raises(BackendError, match=r"KV hand-off .* passed 0\.2 s") as caught:
            await c.post(CHAT, chat(), ctx())
        assert caught.value.kind == "timeout"
        assert c.stats.handoff_over_bound == {"json": 1}
        assert c.inflight() == 0
    finally:
        released.set()
        await c.aclose()


async def test_a_client_error_is_relayed_not_retried(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: answering(400, {"error": "bad"})})
    c = client(up)
    answer = await c.open_stream(CHAT, chat("hi", stream=True), ctx())
    assert answer.status == 400
    assert orjson.loads(await answer.read_all()) == {"error": "bad"}
    assert len(up.bodies(DECODE_1)) == 1
    assert c.inflight() == 0
    await c.aclose()


async def test_a_stream_broken_after_the_first_bytes_raises_and_frees_the_slot(
    upstream: Make,
) -> None:
    received_first = asyncio.Event()

    async def cut(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
        await received_first.wait()
        assert request.transport is not None
        request.transport.close()  # the server dies mid-answer: the chunked body is cut short
        return response

    up = await upstream({PREFILL: prefill_ok, DECODE_1: cut})
    c = client(up)
    answer = await c.open_stream(CHAT, chat(stream=True), ctx())
    received = []
    with pytest.raises(BackendError) as broken:
        async for chunk in answer.chunks():
            received.append(chunk)
            received_first.set()
    assert len(received) == 1 and broken.value.kind == "broken"
    assert c.inflight() == 0
    # It answered: a handler failing mid-stream is not a dead server (the next connection
    # it refused, or its health check, would eject it).
    assert c.decode_pool.servers[0].healthy
    assert c.decode_pool.servers[0].errors["broken"] == 1
    await c.aclose()


async def reset_before_headers(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """The connection is accepted, then closed before any answer (a server being killed)."""
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def cut_after_headers(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """The answer's headers go out (vLLM sends a stream's before the engine runs), then the
    connection closes before the first byte of the body: a server killed meanwhile."""
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream" if body.get("stream") else "application/json"}
    )
    if not body.get("stream"):
        response.content_length = 64
    await response.prepare(request)  # sends the headers now
    assert request.transport is not None
    request.transport.close()
    return response


async def error_before_first_event(
    request: web.Request, body: dict[str, Any]
) -> web.StreamResponse:
    """vLLM's answer when the KV pull failed: a 500, or a stream whose first event is one."""
    if body.get("stream"):
        error = b'data: {"error":{"message":"Internal server error","code":500}}\n\n'
        return await sse(request, error, b"data: [DONE]\n\n")
    return json_answer(500, {"error": {"code": 500}})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("failing", "kind"),
    [
        (reset_before_headers, "unreachable"),
        (cut_after_headers, "broken"),
        (error_before_first_event, "broken"),
    ],
)
async def test_a_decode_server_failing_before_the_first_byte_is_replaced_by_another(
    failing: Behaviour, kind: str, stream: bool, upstream: Make
) -> None:
    """Whatever the failure, the retry goes to another decode server: the failing one is the
    request's first choice (a session pins the order) and would fail again."""
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok, DECODE_2: decode_ok})
    c = client(up, decode=(DECODE_1, DECODE_2))
    order = [up.name(s.url) for s in c.router.placement.rank(c.decode_pool.servers, _key(c))]
    first, second = order
    up.behaviour[first] = failing
    request = chat(stream=stream)
    if stream:
        answer = await c.open_stream(CHAT, request, ctx(session_affinity="s"))
        assert answer.status == 200
        received = b"".join([chunk async for chunk in answer.chunks()])
        assert b'"Hi"' in received and received.endswith(b"data: [DONE]\n\n")
    else:
        answer = await c.post(CHAT, request, ctx(session_affinity="s"))
        assert answer.status == 200
        assert orjson.loads(answer.body) == {"choices": [{"message": {"content": "Hi"}}]}
    assert len(up.bodies(first)) == 1 and len(up.bodies(second)) == 1
    # an unreachable server never read the KV; one that answered may have: recompute
    kv = up.bodies(second)[0].get("kv_transfer_params")
    assert kv == (PARAMS if kind == "unreachable" else None)
    failed = next(s for s in c.decode_pool.servers if s.url == up.url(first))
    assert failed.errors == {kind: 1}
    assert failed.healthy is (kind != "unreachable")  # an answer is not a dead server
    assert c.stats.hops == {"prefill": 1, "decode": 1, "decode_retry": 1}
    assert c.inflight() == 0
    await c.aclose()


async def test_every_decode_server_down_is_unavailable_then_readmitted(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok}, down={DECODE_1})
    c = client(up, health_interval_s=7)
    with pytest.raises(BackendError) as first:
        await c.post(CHAT, chat(), ctx())
    assert first.value.kind == "unreachable"  # tried, failed, nothing else to try
    with pytest.raises(BackendError) as then:
        await c.post(CHAT, chat(), ctx())
    assert then.value.kind == "unavailable" and then.value.retry_after_s == 7
    assert not await c.ready()
    await up.set_down(DECODE_1, False)  # the server is back: the next health check re-admits it
    assert await c.ready()
    assert (await c.post(CHAT, chat(), ctx())).status == 200
    await c.aclose()
