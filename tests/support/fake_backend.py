"""An in-process stand-in for a vLLM server, for fast unit tests of the HTTP surface only.

It never replaces the real vLLM in the tests that prove a feature (tests marked ``slow``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.protocol import BackendError, RequestContext, UpstreamResponse


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

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        self.calls.append((path, body))
        if self.fail:
            raise self.fail
        return UpstreamResponse(status=200, body=orjson.dumps(self._completion(body)))

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> FakeStream:
        self.calls.append((path, body))
        if self.fail:
            raise self.fail
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
