"""The official ``anthropic`` SDK against ``semcache serve`` in front of a real vLLM (the
tiny Llama, its tools rendered by its template and read back by vLLM's hermes parser)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from server.limits.settings import LimitSettings
from tests.conftest import gateway_config

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
"""Greedy sampling, so answers are cached: the SDK takes ``temperature`` only as an extra
body field."""


def wire(kw: dict[str, Any]) -> dict[str, Any]:
    """The JSON body the SDK sends for ``kw``: its ``extra_body`` merged in."""
    return {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw.get("extra_body", {})}


def client(gateway: GatewayProcess, key: str = "key-a", **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, **kw)


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_create_is_cached_per_tenant_and_shared_with_the_chat_route(
    gateway: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    a, b = client(gateway, "key-a"), client(gateway, "key-b")
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "system": "You are terse.", **GREEDY}
    first = a.messages.with_raw_response.create(messages=ask("Spring weather?"), **kw)
    message = first.parse()
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 12
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    assert "etag" not in first.headers and "content-location" not in first.headers

    again = a.messages.with_raw_response.create(messages=ask("Spring weather?"), **kw)
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert again.parse().content == message.content
    other = b.messages.with_raw_response.create(messages=ask("Spring weather?"), **kw)
    assert other.headers["cf-aig-cache-status"] == "MISS"  # another tenant's

    # the same key as a bearer token is the same tenant; the chat twin is the same entry
    bearer = anthropic.Anthropic(base_url=gateway.url, auth_token="key-a", max_retries=0)
    same = bearer.messages.with_raw_response.create(messages=ask("Spring weather?"), **kw)
    assert same.headers["cf-aig-cache-status"] == "HIT"
    chat = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="key-a", max_retries=0)
    twin = chat.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Spring weather?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert twin.headers["cf-aig-cache-status"] == "HIT"
    assert twin.parse().choices[0].message.content == message.content[0].text  # type: ignore[union-attr]

    # what vLLM itself answers to the same Messages request (its own /v1/messages)
    direct = anthropic.Anthropic(base_url=tiny_vllm.url, api_key="x", max_retries=0)
    ref = direct.messages.create(
        messages=ask("Spring weather?"), **{**kw, "model": TINY_MODEL_NAME}
    )
    assert ref.content == message.content and ref.stop_reason == message.stop_reason


def events_of(stream: Any) -> list[dict[str, Any]]:
    """The stream's events without what differs between answers (ids, prefix-cache hits)."""
    out = []
    for event in stream:
        doc = event.model_dump()
        if doc["type"] == "message_start":
            doc["message"].pop("id")
            doc["message"]["usage"] = {"output_tokens": doc["message"]["usage"]["output_tokens"]}
        if doc["type"] == "message_delta":
            doc["usage"] = {"output_tokens": doc["usage"]["output_tokens"]}
        out.append(doc)
    return out


def test_stream_events_and_a_replayed_hit_streams_the_same(gateway: GatewayProcess) -> None:
    a = client(gateway, "key-stream")
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": ask("A spring poem"),
        **GREEDY,
    }
    with a.messages.stream(**kw) as stream:
        live = events_of(stream)
        final = stream.get_final_message()
    types = [e["type"] for e in live]
    assert types[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0
    deltas = "".join(e["delta"]["text"] for e in live if e["type"] == "content_block_delta")
    assert deltas == final.content[0].text  # type: ignore[union-attr]

    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/messages",
        json={**wire(kw), "stream": True},
        headers={"x-api-key": "key-stream", "anthropic-version": "2023-06-01"},
        timeout=60,
    ) as raw:
        assert raw.headers["cf-aig-cache-status"] == "HIT"
        names = [
            line.removeprefix("event: ") for line in raw.iter_lines() if line.startswith("event:")
        ]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    with a.messages.stream(**kw) as stream:
        assert events_of(stream) == live  # the same events, replayed
    as_json = a.messages.create(**kw)
    # the stored stream, answered as JSON (the stream's final message holds the SDK's parsed
    # block types: compared as the wire's dicts)
    assert [b.model_dump(exclude={"parsed_output"}) for b in as_json.content] == [
        b.model_dump(exclude={"parsed_output"}) for b in final.content
    ]


def test_count_tokens_is_the_rendered_prompts(
    gateway: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    a = client(gateway, "key-count")
    counted = a.messages.count_tokens(model=MODEL, system="Be brief.", messages=ask("Hello there"))
    tokenized = httpx.post(
        f"{tiny_vllm.url}/tokenize",
        json={
            "model": TINY_MODEL_NAME,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ],
        },
    ).json()
    assert counted.input_tokens == tokenized["count"] > 0
    made = a.messages.create(
        model=MODEL, system="Be brief.", messages=ask("Hello there"), max_tokens=2, **GREEDY
    )
    assert (
        made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == counted.input_tokens
    )
    with_tools = a.messages.count_tokens(model=MODEL, messages=ask("Hello there"), tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens  # the template renders the tools
    again = httpx.post(
        f"{gateway.url}/v1/messages/count_tokens",
        json={"model": MODEL, "system": "Be brief.", "messages": ask("Hello there")},
        headers={"x-api-key": "key-count"},
    )
    assert again.json() == {"input_tokens": counted.input_tokens}
    assert again.headers["cf-aig-cache-status"] == "HIT"


def test_no_tools_as_an_empty_list(gateway: GatewayProcess) -> None:
    """``tools: []`` (Claude Code's ``--tools ""``) is no tools, which vLLM alone would refuse;
    it shares its entry with the request that names none, and the OpenAI route's too."""
    a = client(gateway, "key-no-tools")
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": ask("No tools?"), **GREEDY}
    empty = a.messages.with_raw_response.create(tools=[], tool_choice={"type": "auto"}, **kw)
    assert empty.headers["cf-aig-cache-status"] == "MISS"
    assert empty.parse().content[0].type == "text"
    plain = a.messages.with_raw_response.create(**kw)
    assert plain.headers["cf-aig-cache-status"] == "HIT"
    chat = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="key-no-tools", max_retries=0)
    answer = chat.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Other, no tools?"), max_tokens=4, temperature=0, tools=[]
    )
    assert answer.parse().choices[0].message.content is not None


def test_a_tool_use_round_trip(gateway: GatewayProcess) -> None:
    a = client(gateway, "key-tools")
    question = ask("What is the weather in Paris?")
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 120, "tools": [WEATHER], **GREEDY}
    used = a.messages.create(
        messages=question, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    assert used.stop_reason == "tool_use"
    (call,) = [b for b in used.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")  # type: ignore[index]
    replayed = a.messages.with_raw_response.create(
        messages=question, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    assert replayed.headers["cf-aig-cache-status"] == "HIT"
    assert replayed.parse().content == used.content

    # one call: "any" guides an array of calls, which random weights would keep adding to
    anyone = a.messages.create(
        messages=question, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw
    )
    assert anyone.stop_reason == "tool_use"
    assert [b.name for b in anyone.content if b.type == "tool_use"] == ["get_weather"]

    with a.messages.stream(
        messages=question, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in used.content]

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    answer = a.messages.create(
        messages=[
            *question,
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {"role": "user", "content": [result]},
        ],
        **{**kw, "max_tokens": 8},
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_bad_requests_in_anthropics_shape(gateway: GatewayProcess) -> None:
    a = client(gateway)
    with pytest.raises(anthropic.BadRequestError) as bad:
        a.messages.create(model=MODEL, max_tokens=0, messages=ask("x"))
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        a.messages.create(model="claude-nope", max_tokens=4, messages=ask("x"))
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as too_long:  # vLLM's refusal, translated
        # an explicit timeout: without one the SDK refuses a large max_tokens unstreamed itself
        a.messages.create(model=MODEL, max_tokens=100_000, messages=ask("x"), timeout=60)
    assert too_long.value.body["type"] == "error"  # type: ignore[index]


@pytest.fixture
def closed(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> Iterator[GatewayProcess]:
    tokens = [
        TokenEntry(token="tok-acme", tenant="acme", limits=LimitSettings(daily_tokens=200)),
        TokenEntry(token="tok-ops", tenant="ops", roles=["admin"]),
    ]
    config = gateway_config(
        tmp_path / "data",
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        auth=AuthSettings(tokens=tokens),
    )
    yield start_gateway(config)


def test_keys_and_budgets_are_the_gateways(closed: GatewayProcess) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(closed, "not-a-token").messages.create(model=MODEL, max_tokens=4, messages=ask("x"))
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    acme = client(closed, "tok-acme")
    spent = 0
    with pytest.raises(anthropic.RateLimitError) as over:
        for n in range(20):  # ~60 tokens each: the daily budget of 200 runs out
            made = acme.messages.create(
                model=MODEL, max_tokens=40, messages=ask(f"Tell me story {n}"), **GREEDY
            )
            spent += made.usage.input_tokens + made.usage.output_tokens
    assert spent > 0
    assert over.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert "daily budget" in over.value.body["error"]["message"]  # type: ignore[index]
    chat = openai.OpenAI(base_url=f"{closed.url}/v1", api_key="tok-acme", max_retries=0)
    with pytest.raises(openai.RateLimitError):  # the same tenant's budget, on the OpenAI route
        chat.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
