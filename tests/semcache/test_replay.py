"""Replay: a stored stream as one JSON answer, a stored JSON answer as OpenAI chunks."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from foundation.sse import MEDIA_TYPE, SSEReader, block_event
from semcache.entry import CachedAnswer, StreamRecorder, Usage
from semcache.replay import ReplayError, as_json, as_stream, wants_usage
from tests.semcache import payloads


def stored_stream(chunks: list[bytes]) -> CachedAnswer:
    rec = StreamRecorder(payloads.MODEL)
    rec.feed_many([*chunks, b"[DONE]"])
    answer = rec.answer()
    assert answer is not None
    return answer


def docs(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(c) for c in chunks]


def chat_text(chunks: list[bytes]) -> str:
    return "".join(ch["delta"].get("content") or "" for d in docs(chunks) for ch in d["choices"])


def test_chat_stream_to_json() -> None:
    doc = orjson.loads(as_json(stored_stream(payloads.chat_stream()), "chat"))
    assert doc["object"] == "chat.completion"
    assert doc["id"] == "chatcmpl-5d0e9a" and doc["model"] == payloads.MODEL
    (choice,) = doc["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Paris is the capital of France."}
    assert choice["finish_reason"] == "stop"
    assert doc["usage"] == {"prompt_tokens": 14, "total_tokens": 22, "completion_tokens": 8}


def test_tool_call_stream_to_json() -> None:
    doc = orjson.loads(as_json(stored_stream(payloads.tool_call_stream()), "chat"))
    (choice,) = doc["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "chatcmpl-tool-3c9f",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert doc["usage"]["completion_tokens"] == 18


def test_completion_stream_to_json() -> None:
    doc = orjson.loads(as_json(stored_stream(payloads.completion_stream()), "completions"))
    assert doc["object"] == "text_completion"
    (choice,) = doc["choices"]
    assert choice["text"] == " Paris, the city of light"
    assert choice["finish_reason"] == "length"
    assert doc["usage"]["total_tokens"] == 11


def test_stream_without_usage_chunk_uses_recorded_usage() -> None:
    answer = stored_stream(payloads.chat_stream(usage=False))
    answer.usage = Usage(14, 8)
    doc = orjson.loads(as_json(answer, "chat"))
    assert doc["usage"] == {"prompt_tokens": 14, "completion_tokens": 8, "total_tokens": 22}


def test_chat_json_to_chunks() -> None:
    answer = CachedAnswer.from_json(payloads.chat_json())
    chunks = as_stream(answer, "chat", include_usage=True)
    ds = docs(chunks)
    assert all(d["object"] == "chat.completion.chunk" for d in ds)
    assert all(d["id"] == "chatcmpl-8f1c2b" and d["created"] == payloads.CREATED for d in ds)
    assert ds[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_text(chunks) == "Paris is the capital of France."
    finish = [d for d in ds if d["choices"] and d["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert ds[-1]["choices"] == [] and ds[-1]["usage"]["completion_tokens"] == 8
    no_usage = as_stream(answer, "chat", include_usage=False)
    assert no_usage == chunks[:-1]


def test_tool_call_json_to_chunks_and_back() -> None:
    answer = CachedAnswer.from_json(payloads.tool_call_json())
    chunks = as_stream(answer, "chat", include_usage=True)
    back = orjson.loads(as_json(stored_stream(chunks), "chat"))
    original = orjson.loads(payloads.tool_call_json())
    assert (
        back["choices"][0]["message"]["tool_calls"]
        == (original["choices"][0]["message"]["tool_calls"])
    )
    assert back["choices"][0]["finish_reason"] == "tool_calls"
    assert back["usage"] == original["usage"]


@pytest.mark.parametrize(
    ("route", "body"),
    [("chat", payloads.chat_json()), ("completions", payloads.completion_json())],
)
def test_json_survives_a_round_trip_through_chunks(route: str, body: bytes) -> None:
    chunks = as_stream(CachedAnswer.from_json(body), route, include_usage=True)
    rebuilt = orjson.loads(as_json(stored_stream(chunks), route))
    original = orjson.loads(body)
    for k in ("id", "created", "model", "usage"):
        assert rebuilt[k] == original[k]
    for a, b in zip(rebuilt["choices"], original["choices"], strict=True):
        assert a["finish_reason"] == b["finish_reason"]
        if route == "chat":
            assert a["message"]["content"] == b["message"]["content"]
            assert a["message"]["role"] == b["message"]["role"]
        else:
            assert a["text"] == b["text"]


def test_stored_stream_keeps_or_drops_its_usage_chunk() -> None:
    original = payloads.chat_stream()
    answer = stored_stream(original)
    assert as_stream(answer, "chat", include_usage=True) == original
    assert as_stream(answer, "chat", include_usage=False) == original[:-1]


def test_usage_chunk_is_synthesised_when_asked_but_not_stored() -> None:
    answer = stored_stream(payloads.chat_stream(usage=False))
    assert as_stream(answer, "chat", include_usage=True) == payloads.chat_stream(usage=False)
    answer.usage = Usage(14, 8)
    last = orjson.loads(as_stream(answer, "chat", include_usage=True)[-1])
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 22
    assert last["object"] == "chat.completion.chunk"


def test_completion_json_to_chunks() -> None:
    chunks = as_stream(
        CachedAnswer.from_json(payloads.completion_json()), "completions", include_usage=False
    )
    ds = docs(chunks)
    assert all(d["object"] == "text_completion" for d in ds)
    assert "".join(d["choices"][0]["text"] for d in ds) == " Paris, the city of light"
    assert ds[-1]["choices"][0]["finish_reason"] == "length"


def test_embeddings_replay_as_json_only() -> None:
    answer = CachedAnswer.from_json(payloads.embeddings_json())
    assert as_json(answer, "embeddings") == payloads.embeddings_json()
    with pytest.raises(ReplayError):
        as_stream(answer, "embeddings", include_usage=False)
    with pytest.raises(ReplayError):
        as_json(CachedAnswer(content_type=MEDIA_TYPE), "chat")


def test_a_responses_stream_replays_as_it_arrived_or_as_its_completed_response() -> None:
    blocks = SSEReader().feed_events(b"".join(payloads.responses_stream()))
    answer = CachedAnswer(content_type=MEDIA_TYPE, chunks=blocks)
    framed = b"".join(block_event(b) for b in as_stream(answer, "responses", include_usage=False))
    assert framed == b"".join(payloads.responses_stream())  # byte for byte
    completed = orjson.loads(payloads.responses_json(rid="resp_98bd1c"))
    assert orjson.loads(as_json(answer, "responses")) == completed
    with pytest.raises(ReplayError):  # JSON answers are cached under other keys
        as_stream(CachedAnswer(body=payloads.responses_json()), "responses", include_usage=True)


def test_wants_usage() -> None:
    assert wants_usage({"stream": True, "stream_options": {"include_usage": True}})
    assert not wants_usage({"stream": True})
    assert not wants_usage({"stream_options": None})
