"""An OpenAI chat completion stream as Anthropic's events (no server)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from foundation.sse import DONE_EVENT, event
from server.anthropic.events import message_events


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    doc = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": choices,
    }
    return event(orjson.dumps({**doc, **extra}))


USAGE = chunk(None, usage={"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9})


async def source(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def events(*parts: bytes) -> list[tuple[str, dict[str, Any]]]:
    raw = b"".join([piece async for piece in message_events(source(*parts))])
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


async def test_a_text_answer_streams_anthropics_event_sequence() -> None:
    got = await events(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}) + chunk({"content": "lo"}),
        chunk({}, "stop"),
        USAGE,
        DONE_EVENT,
    )
    assert [name for name, _ in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = got[0][1]["message"]
    assert start["id"] == "msg_x" and start["role"] == "assistant" and start["content"] == []
    assert got[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta") == "Hello"
    assert got[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": 7, "output_tokens": 2},
    }


async def test_tool_call_deltas_become_a_tool_use_block_of_json_deltas() -> None:
    first = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    more = {"index": 0, "function": {"arguments": '{"city": '}}
    last = {"index": 0, "function": {"arguments": '"Paris"}'}}
    got = await events(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [first]}),
        chunk({"tool_calls": [more]}),
        chunk({"tool_calls": [last]}, "tool_calls"),
        USAGE,
        DONE_EVENT,
    )
    starts = [d["content_block"] for n, d in got if n == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {}},
    ]
    partial = [
        d["delta"]["partial_json"]
        for n, d in got
        if d.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert orjson.loads("".join(partial)) == {"city": "Paris"}
    assert [d["index"] for n, d in got if n == "content_block_stop"] == [0, 1]
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_an_empty_answer_has_one_empty_text_block_and_a_stop_sequence() -> None:
    got = await events(
        chunk({"role": "assistant", "content": ""}),
        chunk(
            {},
            "stop",
        ),
        DONE_EVENT,
    )
    names = [n for n, _ in got]
    assert names[2:4] == ["content_block_start", "content_block_stop"]
    stopped = await events(
        chunk({"content": "a"}),
        event(
            orjson.dumps(
                {
                    "id": "chatcmpl-x",
                    "model": "tiny",
                    "choices": [
                        {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}
                    ],
                }
            )
        ),
        DONE_EVENT,
    )
    assert stopped[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


async def test_a_broken_or_cut_stream_ends_with_an_error_event_and_no_message_stop() -> None:
    broken = await events(
        chunk({"content": "a"}),
        event(
            orjson.dumps({"error": {"message": "backend died", "code": "backend_stream_broken"}})
        ),
    )
    assert broken[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "backend died"}},
    )
    cut = await events(chunk({"content": "a"}))
    assert cut[-1][0] == "error" and "message_stop" not in [n for n, _ in cut]
