"""Backend failures reach the client as clean OpenAI errors: no hang, no trace, no 500; a
decode server that fails before the first byte reaches the client is replaced by another."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.placement import rendezvous_order
from backends.fleet.server_state import ServerState
from backends.launch.process import VllmProcess
from harness.fake_vllm import FakeServer, sse
from harness.gateway import GatewayProcess, GatewayThread
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm
from server.config import GatewayConfig, ModelEntry
from tests.conftest import gateway_config

MESSAGES: list[Any] = [{"role": "user", "content": "Write a very long story."}]


def _only_chat(data_dir: Path, url: str, read_timeout_s: float = 600.0) -> GatewayConfig:
    return GatewayConfig(
        data_dir=str(data_dir),
        models=[ModelEntry(id="tiny-chat", backend="tiny")],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model=TINY_MODEL_NAME,
                revision="test",
                servers=[VllmServer(url=url)],
                read_timeout_s=read_timeout_s,
            )
        ],
    )


@pytest.fixture
def dead_gateway(data_dir: Path) -> Iterator[GatewayThread]:
    gw = GatewayThread(_only_chat(data_dir, f"http://127.0.0.1:{free_port()}")).start()
    yield gw
    gw.stop()


def test_unreachable_backend_is_502_or_503_with_retry_after(dead_gateway: GatewayThread) -> None:
    for stream in (False, True):
        r = httpx.post(
            f"{dead_gateway.url}/v1/chat/completions",
            json={"model": "tiny-chat", "messages": MESSAGES, "stream": stream},
        )
        # 502 while the gateway still tries the server; 503 once its health checks ejected it
        # (every server of the pool down), both with Retry-After
        assert r.status_code in (502, 503)
        assert r.headers["retry-after"]
        code = {502: "backend_error", 503: "backend_unavailable"}[r.status_code]
        assert r.json()["error"]["code"] == code
    ready = httpx.get(f"{dead_gateway.url}/ready")
    assert ready.status_code == 503
    assert ready.json()["backends"] == {"tiny": False}


KV_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e"}
ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 90, "completion_tokens": 1, "total_tokens": 91},
}


async def _prefill(request: web.Request) -> web.StreamResponse:
    if request.path == "/v1/chat/completions":
        return web.json_response({"choices": [], "kv_transfer_params": KV_PARAMS})
    return web.Response()  # /health, /metrics


async def _decode(request: web.Request) -> web.StreamResponse:
    if request.path != "/v1/chat/completions":
        return web.Response()
    if orjson.loads(await request.read()).get("stream"):
        hi = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
        return await sse(request, hi, b"data: [DONE]\n\n")
    return web.json_response(ANSWER)


async def _killed_after_headers(request: web.Request) -> web.StreamResponse:
    """Headers out (vLLM sends a stream's before its engine runs), then the connection closes
    before the first event: the server was killed while the request waited for its KV."""
    if request.path != "/v1/chat/completions":
        return web.Response()
    stream = orjson.loads(await request.read()).get("stream")
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream" if stream else "application/json"}
    )
    if not stream:
        response.content_length = 64
    await response.prepare(request)
    assert request.transport is not None
    request.transport.close()
    return response


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_server_killed_before_the_first_byte_is_replaced(
    data_dir: Path, stream: bool
) -> None:
    """The client gets the other decode server's whole answer, not a 502."""
    prefill = FakeServer(_prefill)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    states = [ServerState(VllmServer(url=url, role="decode"), limit=1) for url in urls]
    owner = rendezvous_order("s", states)[0].url  # the session's first choice dies
    cut: list[str] = []

    async def killed(request: web.Request) -> web.StreamResponse:
        cut.append(request.path)
        return await _killed_after_headers(request)

    decodes = [
        FakeServer(killed if url == owner else _decode, port)
        for url, port in zip(urls, ports, strict=True)
    ]
    servers = [VllmServer(url=prefill.url, role="prefill")]
    servers += [VllmServer(url=d.url, role="decode") for d in decodes]
    backend = VllmBackendConfig(
        name="pd",
        served_model="m",
        revision="test",
        servers=servers,
        prefill_threshold_tokens=8,
        health_interval_s=3600,
    )
    config = GatewayConfig(
        data_dir=str(data_dir),
        cache=False,
        models=[ModelEntry(id="chat", backend="pd")],
        backends=[backend],
    )
    for server in (prefill, *decodes):
        await server.start()
    gw = GatewayThread(config).start()
    try:
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "The cat reads a book. " * 20}],
            "stream": stream,
        }
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(
                f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-affinity": "s"}
            )
        assert r.status_code == 200, r.text
        assert "/v1/chat/completions" in cut  # tried first, cut after its headers
        if stream:
            assert b'"Hi"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
        else:
            assert r.json()["choices"][0]["message"]["content"] == "Hi"
    finally:
        gw.stop()
        for server in (prefill, *decodes):
            await server.stop()


@pytest.mark.slow
def test_backend_timeout_is_504(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    gw = start_gateway(_only_chat(data_dir, tiny_vllm.url, read_timeout_s=0.3))
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": MESSAGES,
            "max_tokens": 1500,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert r.status_code == 504
    assert r.headers["retry-after"]
    assert r.json()["error"]["code"] == "backend_timeout"


async def _kill_mid_stream(
    data_dir: Path, start_gateway: Callable[[GatewayConfig], GatewayProcess]
) -> tuple[openai.APIError | None, set[int]]:
    """Start a stream, SIGKILL vLLM once it has begun; (the error raised, choices finished).

    Afterwards the dead backend must give a clean 502/503 with Retry-After.
    """
    process = await start_tiny_vllm(data_dir, free_port(), progress=None)
    gw: GatewayProcess | None = None
    try:
        gw = start_gateway(
            gateway_config(
                data_dir, process.url, data_dir / "models" / TINY_MODEL_NAME, embeddings=False
            )
        )
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="t", max_retries=0, timeout=60)
        # warm: a fresh server's first answer can lag behind its own generation
        await client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4)
        # 4 sampled choices of 1500 tokens: never cached, and long
        stream = await client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": f"Write a long story {uuid.uuid4().hex}."}],
            max_tokens=1500,
            n=4,
            temperature=1.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert stream.response.status_code == 200  # the answer has begun
        started = time.monotonic()
        process.kill()
        finished: set[int] = set()
        error: openai.APIError | None = None
        try:
            async for chunk in stream:
                finished.update(c.index for c in chunk.choices if c.finish_reason)
        except openai.APIError as exc:
            error = exc
        assert time.monotonic() - started < 30  # no hang
        # afterwards: a clean 502 with Retry-After, in OpenAI's shape
        with pytest.raises(openai.APIStatusError) as after:
            await client.chat.completions.create(model="tiny-chat", messages=MESSAGES)
        assert after.value.status_code in (502, 503)  # unreachable, or ejected: all down
        assert after.value.response.headers["retry-after"]
        return error, finished
    finally:
        if gw is not None:
            gw.stop()
        await process.stop()


@pytest.mark.slow
async def test_backend_killed_mid_stream_ends_cleanly(
    data_dir: Path, start_gateway: Callable[[GatewayConfig], GatewayProcess]
) -> None:
    """A stream cut by the backend's death ends with an error event, never silently.

    On a quiet machine vLLM can have written the whole answer into the socket buffers before
    the kill lands; such an attempt (every choice finished) did not test anything and is run
    again. A stream that ends with unfinished choices and no error fails at once.
    """
    for _ in range(3):
        error, finished = await _kill_mid_stream(data_dir, start_gateway)
        if error is not None:
            assert "backend" in str(error.message).lower()
            return
        assert finished == {0, 1, 2, 3}, "the stream ended early without an error event"
    pytest.fail("vLLM finished 3 times before the kill: the test could not cut a stream")
