"""Through the app ``create_app`` builds, against a local fake vLLM whose ``/metrics`` says
it queues: the dispatch gate holds misses in the fair queue, and cache hits never wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from backends.config import VllmBackendConfig, VllmServer
from backends.vllm.client import VllmClient
from harness.fake_vllm import FakeServer
from harness.gateway import GatewayThread
from server.config import GatewayConfig, ModelEntry

CHAT = "/v1/chat/completions"
WAITING_PAGE = (
    "# HELP vllm:num_requests_waiting Waiting.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} 5\n'
)


class QueueingVllm:
    """Answers chat at once, except the prompt ``slow`` (held until ``release``); its
    ``/metrics`` always reports five requests waiting inside vLLM. Runs in its own thread's
    event loop (the gateway runs in another)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.server = FakeServer(self.handle)
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=10)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def stop(self) -> None:
        self.release()
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            return web.Response(text=WAITING_PAGE)
        if request.path == CHAT:
            body = await request.json()
            prompt = body["messages"][0]["content"]
            self.calls.append(prompt)
            if prompt == "slow":
                await self._release.wait()
            message = {"role": "assistant", "content": f"answer to {prompt}"}
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        return web.Response(status=200)


def chat(prompt: str) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": prompt}], "seed": 7}


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for the gateway's thread to reach a state."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_held_pool_queues_misses_and_answers_hits(tmp_path: Path) -> None:
    fake = QueueingVllm()
    fake.start()
    config = GatewayConfig(
        data_dir=str(tmp_path / "data"),
        models=[ModelEntry(id="chat", backend="b")],
        backends=[
            VllmBackendConfig(
                name="b",
                served_model="m",
                revision="pinned",
                servers=[VllmServer(url=fake.server.url)],
                max_inflight_per_server=8,
                hold_above_waiting=0,
                health_interval_s=0.1,
                scrape_idle_interval_s=0.1,
            )
        ],
    )
    gateway = GatewayThread(config).start()
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http, ThreadPoolExecutor(2) as pool:
            first = http.post(CHAT, json=chat("cached"))
            assert first.status_code == 200 and first.headers["cf-aig-cache-status"] == "MISS"
            backend = gateway.app.state.registry.generation["b"]
            assert isinstance(backend, VllmClient)
            (server,) = backend.decode_pool.servers
            until(lambda: server.held, "the scrape says vLLM queues: the server is held")
            slow = pool.submit(http.post, CHAT, json=chat("slow"))
            # the gateway runs nothing there: one request goes
            until(lambda: server.inflight == 1, "the slow request runs")
            miss = pool.submit(http.post, CHAT, json=chat("new"))
            admission = backend.decode_pool.admission
            until(lambda: admission.waiting == 1, "the miss waits: 1 of 8 slots used, held")
            hit = http.post(CHAT, json=chat("cached"))
            assert hit.status_code == 200 and hit.headers["cf-aig-cache-status"] == "HIT"
            assert not miss.done() and fake.calls == ["cached", "slow"]
            fake.release()  # the slow one ends: its slot passes to the queued miss
            answers = [slow.result(timeout=30), miss.result(timeout=30)]
            assert [a.status_code for a in answers] == [200, 200]
            assert fake.calls == ["cached", "slow", "new"]
    finally:
        gateway.stop()
        fake.stop()
