"""A Messages request as the chat completion it means, and a chat completion as a Messages
answer (no server)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import orjson
import pytest

from semcache.cache_keys import canonical_request
from server.anthropic.protocol import MessagesRequest, TokenCountRequest
from server.anthropic.translate import chat_request, message_body, stop_reason, tokenize_request
from server.errors import ApiError

TOOL = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    return msgspec.convert({**body, **fields}, MessagesRequest)


def test_a_plain_request_is_the_chat_request_it_means() -> None:
    req = request(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": "Be brief."},
        ],
        temperature=0,
        top_k=5,
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        stream=True,
    )
    assert chat_request(req) == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 16,
        "temperature": 0,
        "top_k": 5,
        "stop": ["END"],
        "user": "u1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_messages_request_and_its_chat_twin_share_a_cache_key() -> None:
    req = request(system="Be brief.", temperature=0)
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 16,
        "temperature": 0.0,
    }
    assert canonical_request("chat", chat_request(req)) == canonical_request("chat", chat)
    streamed = chat_request(request(system="Be brief.", temperature=0, stream=True))
    assert canonical_request("chat", streamed) == canonical_request("chat", chat)


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages() -> None:
    req = request(
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Let me check.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )
    body = chat_request(req)
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
            "content": "Checking.",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": TOOL["input_schema"],
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("kind", "openai"), [("auto", "auto"), ("any", "required"), ("none", "none")]
)
def test_tool_choice_types_map_to_openais(kind: str, openai: str) -> None:
    assert chat_request(request(tools=[TOOL], tool_choice={"type": kind}))["tool_choice"] == openai


def test_bad_input_is_refused_with_the_field_named() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.convert(
            {"model": "m", "messages": [{"role": "user", "content": "x"}]}, MessagesRequest
        )
    with pytest.raises(msgspec.ValidationError, match="document"):
        request(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    with pytest.raises(msgspec.ValidationError, match=r"tools\[0\]"):
        request(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(ApiError, match=r"tool_choice\.name"):
        chat_request(request(tools=[TOOL], tool_choice={"type": "tool"}))
    with pytest.raises(ApiError, match="user message"):
        chat_request(
            request(
                messages=[
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                ]
            )
        )


def test_count_tokens_asks_vllm_to_render_the_same_prompt() -> None:
    req = msgspec.convert(
        {
            "model": "m",
            "system": "S",
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [TOOL],
        },
        TokenCountRequest,
    )
    body = tokenize_request(req)
    assert body["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
    ]
    assert body["tools"][0]["function"]["name"] == "get_weather"


def chat_answer(message: dict[str, Any], finish: str, **choice: Any) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion",
            "created": 1,
            "model": "tiny",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 3,
                "total_tokens": 13,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    )


def test_a_chat_answer_becomes_a_message() -> None:
    doc = orjson.loads(message_body(chat_answer({"role": "assistant", "content": "Hello"}, "stop")))
    assert doc == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4},
    }


def test_a_tool_call_answer_becomes_a_tool_use_block() -> None:
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    answer = chat_answer({"role": "assistant", "content": None, "tool_calls": [call]}, "stop")
    doc = orjson.loads(message_body(answer))
    assert doc["content"] == [
        {
            "type": "tool_use",
            "id": "chatcmpl-tool-1",
            "name": "get_weather",
            "input": {"city": "Paris"},
        }
    ]
    assert doc["stop_reason"] == "tool_use"


def test_stop_reasons() -> None:
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 128009, False) == ("end_turn", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    empty = orjson.loads(message_body(chat_answer({"role": "assistant", "content": ""}, "length")))
    assert empty["content"] == [{"type": "text", "text": ""}]
    assert empty["stop_reason"] == "max_tokens"
