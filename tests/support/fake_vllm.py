"""A stand-in for a vLLM server on a real local port, for tests of the gateway around it.

It answers chat completions (a new text each time), ``/v1/models`` and ``/version``; it
runs its aiohttp server in its own thread's event loop, so a test that blocks (a sync
client, a test client, a child gateway process) is still answered.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from tests.support.fake_upstream import FakeServer


class FakeVllm:
    """Answers chat with a new text each time; reports ``root`` as its model folder. Runs in
    its own thread's event loop (the test client blocks the test's loop while it waits)."""

    def __init__(self) -> None:
        self.root = "/models/a"
        self.calls = 0
        self._n = itertools.count()
        self.server = FakeServer(self.handle)
        self.url = self.server.url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> None:
        self._thread.start()
        self._run(self.server.start())

    def stop(self) -> None:
        self._run(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/chat/completions":
            self.calls += 1
            text = f"answer {next(self._n)}"
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        if request.path == "/v1/models":
            entry = {"id": "m", "object": "model", "root": self.root, "max_model_len": 2048}
            return web.json_response({"object": "list", "data": [entry]})
        if request.path == "/version":
            return web.json_response({"version": "0.32.0"})
        return web.Response(text="")
