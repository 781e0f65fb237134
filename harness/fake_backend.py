"""An in-process stand-in for a vLLM server, for fast unit tests of the HTTP surface only.

It never replaces the real vLLM in the tests that prove a feature (tests marked ``slow``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.protocol import BackendError, UpstreamResponse
from foundation.request import RequestContext


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

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
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
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
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
