"""Tool calling through ``semcache serve`` on real vLLM (the tiny Llama's template renders
the tools; its servers run vLLM's hermes parser): ``tool_choice`` auto, required and a named
function on the OpenAI route and on Workers AI, and a tool call's answer cached and replayed,
streamed deltas included."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from harness.gateway import GatewayProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
"""A call takes the tiny tokenizer ~60 tokens (``<tool_call>{...}</tool_call>``, which vLLM's
hermes format frames the JSON with): ``max_tokens`` leaves room for all of it."""
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def gw(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="tools", max_retries=0)


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, orjson.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_every_tool_choice_is_answered(gw: openai.OpenAI, choice: str) -> None:
    tool_choice: Any = NAMED if choice == "named" else choice
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    # one call: "required" guides an array of calls, which random weights would keep adding to
    kw["parallel_tool_calls"] = False
    raw = gw.chat.completions.with_raw_response.create(tool_choice=tool_choice, temperature=0, **kw)
    message = raw.parse().choices[0].message
    if choice in ("required", "named"):  # guided decoding: a call whatever the weights
        ((name, args),) = calls_of(message)
        assert name == "get_weather" and args["city"] in ("Paris", "Rome")
    again = gw.chat.completions.with_raw_response.create(
        tool_choice=tool_choice, temperature=0, **kw
    )
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert again.parse().choices[0].message.model_dump() == message.model_dump()


def streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The calls assembled from a stream's tool-call deltas, and how many deltas there were."""
    calls: dict[int, dict[str, str]] = {}
    deltas = 0
    for chunk in chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                deltas += 1
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
    return [(c["name"], orjson.loads(c["arguments"])) for c in calls.values()], deltas


def test_a_streamed_tool_call_is_stored_and_replayed(
    gw: openai.OpenAI, gateway: GatewayProcess
) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "And the weather in Rome?"}],
        "tools": TOOLS,
        "tool_choice": NAMED,
        "max_tokens": 120,
        "temperature": 0,
    }
    live = list(gw.chat.completions.create(stream=True, **kw))
    calls, deltas = streamed_calls(live)
    assert [name for name, _ in calls] == ["get_weather"] and deltas >= 1
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json={**kw, "stream": True},
        headers={"authorization": "Bearer tools"},
        timeout=60,
    ) as hit:
        assert hit.headers["cf-aig-cache-status"] == "HIT"
        replay = [
            openai.types.chat.ChatCompletionChunk.model_validate_json(line.removeprefix("data: "))
            for line in hit.iter_lines()
            if line.startswith("data: {")
        ]
    assert streamed_calls(replay) == (calls, deltas)  # the same deltas, replayed
    as_json = gw.chat.completions.with_raw_response.create(**kw)  # the stored stream, as JSON
    assert as_json.headers["cf-aig-cache-status"] == "HIT"
    message = as_json.parse().choices[0].message
    assert calls_of(message) == calls
    assert message.tool_calls and message.tool_calls[0].id  # type: ignore[union-attr]


def test_workers_ai_takes_tools_and_tool_choice(gateway: GatewayProcess) -> None:
    run = f"{gateway.url}/client/v4/accounts/acc/ai/run/@cf/test/tiny"
    auth = {"authorization": "Bearer tools-wai"}
    body: dict[str, Any] = {
        "messages": ASK,
        "tools": [TOOLS[0]["function"]],  # Workers AI's own form of a tool
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_tokens": 120,
        "temperature": 0,
    }
    r = httpx.post(run, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    (call,) = r.json()["result"]["tool_calls"]
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Paris", "Rome")
    auto = httpx.post(run, json={**body, "tool_choice": "auto"}, headers=auth, timeout=60)
    assert auto.status_code == 200, auto.text
    with httpx.stream("POST", run, json={**body, "stream": True}, headers=auth, timeout=60) as s:
        assert s.headers["cf-aig-cache-status"] == "HIT"  # the JSON answer above, streamed
        events = [orjson.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    (streamed,) = [e["tool_calls"] for e in events if "tool_calls" in e]
    assert streamed == [call]
    assert "usage" in events[-1]
