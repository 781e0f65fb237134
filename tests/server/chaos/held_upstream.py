"""A stand-in vLLM whose answers are held until the test releases them.

The SIGTERM test needs requests that are provably in flight for as long as it probes the
drain; a real vLLM finishes the tiny model's answers in a time that depends on the machine.
This server answers like vLLM's OpenAI routes (a first stream chunk at once, the rest, or the
whole JSON answer, once released), in its own thread and event loop.
"""

from __future__ import annotations

import asyncio
import threading

import orjson
from aiohttp import web

from harness.ports import free_port


def _chunk(model: str, index: int, content: str, finish: str | None) -> bytes:
    choice = {"index": index, "delta": {"content": content}, "finish_reason": finish}
    doc = {
        "id": "held",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class HeldUpstream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.held = 0
        """Chat requests waiting for :meth:`release`."""
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/health":
            return web.Response(text="")
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": 2048}
            return web.json_response({"object": "list", "data": [card]})
        if path != "/v1/chat/completions":
            return web.Response(text="")  # /metrics and the rest: nothing to say
        body = orjson.loads(await request.read())
        self.held += 1
        try:
            if not body.get("stream"):
                await self._release.wait()
                message = {"role": "assistant", "content": "held answer"}
                choice = {"index": 0, "message": message, "finish_reason": "length"}
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                doc = {
                    "id": "held",
                    "object": "chat.completion",
                    "created": 0,
                    "model": self.model,
                    "choices": [choice],
                    "usage": usage,
                }
                return web.json_response(doc)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_chunk(self.model, 0, "held", None))
            await self._release.wait()
            await response.write(_chunk(self.model, 0, " answer", "length"))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.held -= 1

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def start(self) -> HeldUpstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def stop(self) -> None:
        self.release()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
