"""OpenAI answers as Workers-AI results: a JSON completion and an event stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from server.workers_ai.translate import text_result, workers_stream


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def _chunks(*payloads: bytes) -> AsyncIterator[bytes]:
    for p in payloads:
        yield p


async def test_openai_stream_becomes_workers_ai_events() -> None:
    def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta}], **extra})

    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    source = _chunks(
        chunk({"role": "assistant", "content": ""}) + b"\n\n" + chunk({"content": "Hel"}),
        b"\n\n" + chunk({"content": "lo"}) + b"\n\n",
        b"data: " + orjson.dumps({"choices": [], "usage": {**usage, "prompt_tokens_details": {}}}),
        b"\n\ndata: [DONE]\n\n",
    )
    out = b"".join([c async for c in workers_stream(source)]).decode()
    assert out == (
        'data: {"response":"Hel"}\n\n'
        'data: {"response":"lo"}\n\n'
        f'data: {{"response":"","usage":{json.dumps(usage, separators=(",", ":"))}}}\n\n'
        "data: [DONE]\n\n"
    )
    cut = _chunks(chunk({"content": "Hel"}) + b"\n\n")
    events = sse_events(b"".join([c async for c in workers_stream(cut)]).decode())
    assert events[0] == '{"response":"Hel"}' and "errors" in events[-1] and "[DONE]" not in events


def test_completion_becomes_workers_ai_result_with_tool_calls() -> None:
    answer = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
                    ],
                }
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    assert text_result("chat", orjson.dumps(answer)) == {
        "response": "",
        "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
