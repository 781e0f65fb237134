"""Requests past the model's context through `semcache serve` in front of the tiny vLLM (a
2,048-token context), with the clients that read each API's limit errors: the openai SDK
and LangChain's ChatOpenAI (``context_length_exceeded``: ``ContextOverflowError``), the
anthropic SDK as Claude Code uses it (the sum it reads, then a retry with a ``max_tokens``
computed from it) and LangChain's ChatAnthropic (``prompt is too long``), Workers AI's
envelope; and an unknown model in OpenAI's words."""

from __future__ import annotations

import re
from typing import Any

import anthropic
import httpx
import openai
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.exceptions import ContextOverflowError
from langchain_openai import ChatOpenAI

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME

pytestmark = pytest.mark.slow

CONTEXT = 2048
MODEL = "tiny-chat"
TEXT = " ".join(f"w{i % 97}" for i in range(3000))
"""A prompt well past the context."""
CLAUDE_CODE = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)
"""What Claude Code reads to retry with a smaller ``max_tokens``."""
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def tokens(vllm: VllmProcess, text: str) -> int:
    """The prompt's tokens as vLLM counts them itself."""
    body = {"model": TINY_MODEL_NAME, "messages": ask(text)}
    count: int = httpx.post(f"{vllm.url}/tokenize", json=body, timeout=60).json()["count"]
    return count


def test_openai_chat_over_the_window_is_context_length_exceeded(
    gateway: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    gw = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test", max_retries=0)
    counted = tokens(tiny_vllm, TEXT)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            gw.chat.completions.create(model=MODEL, messages=ask(TEXT), stream=stream)
        assert err.value.status_code == 400
        assert err.value.code == "context_length_exceeded"
        assert err.value.param == "messages"
        assert err.value.type == "invalid_request_error"
        assert f"Your messages resulted in {counted} tokens" in err.value.message
    # a stream's refusal is JSON with its status, before any event, and never cached
    body = {"model": MODEL, "messages": ask(TEXT), "stream": True, "temperature": 0}
    for _ in range(2):
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        assert r.headers["cache-control"] == "no-store"
        assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as big:
        gw.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=100_000)
    assert (big.value.code, big.value.param) == ("invalid_value", "max_tokens")


def test_langchain_chat_openai_raises_context_overflow(gateway: GatewayProcess) -> None:
    llm = ChatOpenAI(model=MODEL, base_url=f"{gateway.url}/v1", api_key="test", max_retries=0)
    with pytest.raises(ContextOverflowError):
        llm.invoke(TEXT)


def test_anthropic_max_tokens_past_the_context_then_claude_codes_retry(
    gateway: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    a = anthropic.Anthropic(base_url=gateway.url, api_key="key-a", max_retries=0)
    question = "Tell me about the weather in spring."
    with pytest.raises(anthropic.BadRequestError) as err:  # Claude Code's default, streamed
        a.messages.create(model=MODEL, max_tokens=32000, messages=ask(question), stream=True)
    assert err.value.status_code == 400
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    said = err.value.body["error"]["message"]  # type: ignore[index]
    match = CLAUDE_CODE.search(said)
    assert match is not None, said
    prompt, asked, context = map(int, match.groups())
    assert (prompt, asked, context) == (tokens(tiny_vllm, question), 32000, CONTEXT)
    retried = a.messages.create(model=MODEL, max_tokens=context - prompt, messages=ask(question))
    assert retried.type == "message" and retried.content
    usage = retried.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt


def test_anthropic_prompt_over_the_window_is_too_long(
    gateway: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    a = anthropic.Anthropic(base_url=gateway.url, api_key="key-a", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        a.messages.create(model=MODEL, max_tokens=64, messages=ask(TEXT))
    error = err.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert (
        error["message"] == f"prompt is too long: {tokens(tiny_vllm, TEXT)} tokens > 2048 maximum"
    )
    assert TOO_LONG.fullmatch(error["message"])
    llm = ChatAnthropic(
        model=MODEL, base_url=gateway.url, api_key="key-a", max_retries=0, max_tokens=64
    )
    with pytest.raises(ContextOverflowError):
        llm.invoke(TEXT)


def test_workers_ai_prompt_over_the_window_is_its_envelope(gateway: GatewayProcess) -> None:
    r = httpx.post(
        f"{gateway.url}/client/v4/accounts/acc/ai/run/@cf/test/tiny",
        json={"messages": ask(TEXT)},
        headers={"authorization": "Bearer a-tenant"},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["success"] is False and doc["result"] is None
    (error,) = doc["errors"]
    assert "exceeds this model's context window limit (2048 tokens)" in error["message"]


def test_an_unknown_model_is_openais_model_not_found(gateway: GatewayProcess) -> None:
    gw = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        gw.chat.completions.create(model="gpt-nope", messages=ask("hi"))
    assert err.value.status_code == 404
    assert err.value.body == {  # the SDK hands over the error object
        "message": "The model `gpt-nope` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
