"""The one fake vLLM, for fast unit tests (and bench's probes that must leave the model out).

It never replaces the real vLLM in the tests that prove a feature (tests marked ``slow``
run a real one) nor in the benches' claims about serving a model. Three forms:

- ``FakeGeneration``: an in-process generation backend (what ``ModelRegistry`` holds), for
  unit tests of the HTTP surface: a fixed answer, the calls it was sent, failures on demand;
- ``FakeServer``: a real local HTTP server on its own port with a handler the test writes,
  for the backend client's tests (connection pool, timeouts, refused connections, bodies cut
  short); it goes down (connections refused) and comes back on the same port;
- ``FakeVllm``: a server answering vLLM's OpenAI routes (chat, JSON or streamed,
  ``/v1/models``, ``/version``, ``/health``, ``/metrics``) in its own thread's event loop,
  so a test that blocks (a sync client, a child gateway process) is still answered; its
  answers can be held until released, paced, or watched as they arrive; ``serve_forever``
  runs it as a process of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson
from aiohttp import web

from backends.interfaces import BackendError, UpstreamResponse
from foundation.request import RequestContext
from harness.ports import free_port

# -- in process ------------------------------------------------------------------------------


class FakeStream:
    def __init__(self, chunks: list[bytes], fail_after: int | None = None) -> None:
        self.status = 200
        self.content_type = "text/event-stream"
        self._chunks = chunks
        self._fail_after = fail_after
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, c in enumerate(self._chunks):
            if self._fail_after is not None and i >= self._fail_after:
                raise BackendError("unreachable", "backend fake died")
            yield c

    async def read_all(self) -> bytes:
        return b"".join(self._chunks)

    async def aclose(self) -> None:
        self.closed = True


class FakeGeneration:
    """Answers every request with a fixed text; records what it was sent."""

    def __init__(self, name: str = "fake", served_model: str = "fake-model") -> None:
        self.name = name
        self.served_model = served_model
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: BackendError | None = None
        self.fail_stream_after: int | None = None
        self.cut_stream_at: int | None = None
        self.served = 0
        self.stored: dict[str, bytes] = {}
        self.prefix_cached: int | None = None
        """When set, answers say this many prompt tokens came from vLLM's prefix cache."""

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if self.prefix_cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.prefix_cached}
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }

    def _response(self, body: dict[str, Any]) -> dict[str, Any]:
        """A Responses API answer, kept for ``fetch`` unless the request says ``store: false``."""
        self.served += 1
        rid = f"resp_fake{self.served}"
        output = [{"type": "message", "role": "assistant", "content": [{"text": "hello"}]}]
        doc = {"id": rid, "object": "response", "model": body["model"], "status": "completed"}
        doc = {**doc, "output": output, "usage": {"input_tokens": 3, "output_tokens": 1}}
        if body.get("store", True):
            self.stored[rid] = orjson.dumps(doc)
        return doc

    def _response_events(self, body: dict[str, Any]) -> list[bytes]:
        done = self._response(body)
        head = {**done, "status": "in_progress", "output": [], "usage": None}

        def named(name: str, doc: dict[str, Any]) -> bytes:
            return f"event: {name}\ndata: ".encode() + orjson.dumps({**doc, "type": name}) + b"\n\n"

        return [
            named("response.created", {"response": head, "sequence_number": 0}),
            named("response.output_text.delta", {"delta": "hel", "sequence_number": 1}),
            named("response.output_text.delta", {"delta": "lo", "sequence_number": 2}),
            named("response.completed", {"response": done, "sequence_number": 3}),
        ]

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        self.calls.append((path, body))
        if self.fail:
            raise self.fail
        if path == "/v1/responses":
            return UpstreamResponse(status=200, body=orjson.dumps(self._response(body)))
        return UpstreamResponse(status=200, body=orjson.dumps(self._completion(body)))

    async def fetch(self, path: str, ctx: RequestContext) -> UpstreamResponse | None:
        """``GET /v1/responses/{id}`` of a response kept by ``store``."""
        found = self.stored.get(path.rsplit("/", 1)[-1])
        if found is None:
            return UpstreamResponse(status=404, body=b'{"error":{"message":"not found"}}')
        return UpstreamResponse(status=200, body=found)

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> FakeStream:
        self.calls.append((path, body))
        if self.fail:
            raise self.fail
        if path == "/v1/responses":
            events = self._response_events(body)
            if self.cut_stream_at is not None:
                events = events[: self.cut_stream_at]  # ends cleanly, before the last event
            return FakeStream(events, self.fail_stream_after)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body["model"]}
        chunks = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {**base, "choices": [{"index": 0, "delta": {"content": "hel"}}]},
            {
                **base,
                "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}],
            },
        ]
        raw = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
        return FakeStream(raw, self.fail_stream_after)

    async def ready(self) -> bool:
        return self.fail is None

    async def aclose(self) -> None:
        return None


# -- over HTTP: a server with the test's handler ---------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeServer:
    """One local HTTP server on a fixed port; ``start``/``stop`` bring it up and down."""

    def __init__(self, handler: Handler, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._handler = handler
        self._runner: web.AppRunner | None = None

    @property
    def up(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handler)
        # handler_cancellation: a handler that never answers ends when the client gives up
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._runner = runner

    async def stop(self) -> None:
        """Close the listening socket and every open connection: connections are refused."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        await runner.cleanup()
        for _ in range(3):  # let the clients' event loop see the closed keep-alive connections
            await asyncio.sleep(0)


async def sse(request: web.Request, *events: bytes) -> web.StreamResponse:
    """A 200 ``text/event-stream`` answer written one HTTP chunk per event."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response


# -- over HTTP: vLLM's routes ----------------------------------------------------------------

VERSION = "0.32.0"
"""What ``/version`` reports."""


class FakeVllm:
    """Answers vLLM's OpenAI routes on 127.0.0.1 from its own thread's event loop.

    Chat answers ``text`` (``None``: ``answer 0``, ``answer 1``, ... a new one each call) as
    one JSON object, or streamed one word an event (the last with ``finish_reason``, then
    the usage when the request asks for it, then ``[DONE]``), ``pace_s`` apart. With
    ``hold``, answers wait for :meth:`release` (a stream sends its first word first), so a
    test can keep requests in flight. ``/v1/models`` lists ``model`` with ``root`` (the
    folder a restarted server may change: the gateway's remote revision reads it).
    ``on_chat`` sees each chat body as it arrives, in the server's thread."""

    def __init__(
        self,
        model: str = "m",
        *,
        text: str | None = None,
        usage: tuple[int, int] = (1, 1),
        finish_reason: str = "stop",
        pace_s: float = 0.0,
        hold: bool = False,
        root: str = "/models/a",
        on_chat: Callable[[bytes], None] | None = None,
        port: int | None = None,
    ) -> None:
        self.model, self.text, self.usage, self.pace_s = model, text, usage, pace_s
        self.finish_reason = finish_reason
        self.root = root
        self.on_chat = on_chat
        self.calls = 0
        """Chat requests answered or in flight."""
        self.held = 0
        """Chat requests in flight (with ``hold``: those waiting for :meth:`release`)."""
        self._n = itertools.count()
        self.server = FakeServer(self.handle, port)
        self.port, self.url = self.server.port, self.server.url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._released = asyncio.Event()
        if not hold:
            self._released.set()

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> FakeVllm:
        self._thread.start()
        self._run(self.server.start())
        return self

    def release(self) -> None:
        """Let every held answer, and every later one, go."""
        self._loop.call_soon_threadsafe(self._released.set)

    def stop(self) -> None:
        self.release()
        self._run(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def serve_forever(self) -> None:
        """Serve from this thread until the process is stopped (a process of its own)."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self.server.start())
        self._loop.run_forever()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request; a subclass may answer more paths and hand the rest here."""
        if request.path == "/v1/chat/completions":
            return await self.chat(request)
        if request.path == "/v1/models":
            entry = {"id": self.model, "object": "model", "root": self.root, "max_model_len": 2048}
            return web.json_response({"object": "list", "data": [entry]})
        if request.path == "/version":
            return web.json_response({"version": VERSION})
        return web.Response(text="")  # /health, /metrics and the rest: nothing to say

    def _words(self) -> list[str]:
        text = self.text if self.text is not None else f"answer {next(self._n)}"
        return re.findall(r"\s*\S+", text) or [text]

    def _doc(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": "chatcmpl-fake", "object": kind, "created": 0, "model": self.model} | {
            "choices": choices
        }

    def _usage(self) -> dict[str, int]:
        prompt, completion = self.usage
        total = prompt + completion
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if self.on_chat is not None:
            self.on_chat(raw)
        body = orjson.loads(raw)
        self.calls += 1
        words = self._words()
        self.held += 1
        try:
            if not body.get("stream"):
                await self._released.wait()
                if self.pace_s:
                    await asyncio.sleep(self.pace_s * len(words))
                message = {"role": "assistant", "content": "".join(words)}
                choice = {"index": 0, "message": message, "finish_reason": self.finish_reason}
                doc = self._doc("chat.completion", [choice]) | {"usage": self._usage()}
                return web.Response(body=orjson.dumps(doc), content_type="application/json")
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i, word in enumerate(words):
                if i == 1:
                    await self._released.wait()
                last = i == len(words) - 1
                delta = {"index": 0, "delta": {"content": word}}
                choice = delta | {"finish_reason": self.finish_reason if last else None}
                event = orjson.dumps(self._doc("chat.completion.chunk", [choice]))
                await response.write(b"data: " + event + b"\n\n")
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)
            if len(words) == 1:
                await self._released.wait()
            if (body.get("stream_options") or {}).get("include_usage"):
                last_doc = self._doc("chat.completion.chunk", []) | {"usage": self._usage()}
                await response.write(b"data: " + orjson.dumps(last_doc) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.held -= 1
