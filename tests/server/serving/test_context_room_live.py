"""A prompt that leaves less of the model's context than the applied ``max_tokens``, through
`semcache serve` and the shipped policy (chat's default: 256) in front of the tiny vLLM (a
2,048-token context): the gateway's limit is a ceiling, never a cause of refusal. Workers AI
serves it whether the client named ``max_tokens`` or not (even one past the whole context),
and an OpenAI request that named none is served too; each answer stops where the context
ends and its usage says so. An OpenAI request that named a limit past the context is
refused (400), as OpenAI refuses it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig
from tests.conftest import gateway_config

pytestmark = pytest.mark.slow

CONTEXT, PROMPT_TOKENS = 2048, 1900


def long_messages(vllm: httpx.Client) -> tuple[list[dict[str, str]], int]:
    """Messages of about ``PROMPT_TOKENS`` tokens in the tiny model's chat template, and
    their exact count (vLLM's ``/tokenize``)."""

    def sized(words: int) -> tuple[list[dict[str, str]], int]:
        text = " ".join(f"w{i % 97}" for i in range(words))
        messages = [{"role": "user", "content": text}]
        count = vllm.post(
            "/tokenize", json={"model": TINY_MODEL_NAME, "messages": messages}
        ).json()["count"]
        return messages, count

    _, per_500 = sized(500)
    messages, count = sized(500 * PROMPT_TOKENS // per_500)
    assert CONTEXT - 256 < count < CONTEXT - 16, count
    return messages, count


def test_a_prompt_near_the_context_gets_what_the_context_leaves(
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    config = gateway_config(tmp_path / "data", tiny_vllm.url, embeddings=False)
    gw = start_gateway(config)
    with httpx.Client(base_url=tiny_vllm.url, timeout=60) as vllm:
        messages, prompt_tokens = long_messages(vllm)
    room = CONTEXT - prompt_tokens
    run = f"{gw.url}/client/v4/accounts/x/ai/run/@cf/test/tiny"
    asks: list[tuple[str, dict[str, Any]]] = [
        (run, {"messages": messages, "temperature": 0}),
        (run, {"messages": messages, "temperature": 0, "max_tokens": 4096}),
        (f"{gw.url}/v1/chat/completions", {"model": "tiny-chat", "messages": messages}),
    ]
    with httpx.Client(headers={"authorization": "Bearer a-tenant"}, timeout=300) as http:
        for url, body in asks:
            reply = http.post(url, json=body)
            assert reply.status_code == 200, (body.get("max_tokens"), reply.text)
            doc = reply.json()
            usage = (doc["result"] if "result" in doc else doc)["usage"]
            assert usage["prompt_tokens"] == prompt_tokens
            assert 0 < usage["completion_tokens"] <= room
            assert usage["max_tokens_applied"] == room
            assert usage["max_tokens_source"] == "context"
        refused = http.post(asks[2][0], json={**asks[2][1], "max_tokens": 4096})
        assert refused.status_code == 400 and refused.json()["error"]["message"]
