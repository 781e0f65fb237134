"""The policy's max_tokens default and cap through `semcache serve` in front of real vLLM: a
request that names no limit gets the default, one over the cap gets the cap, one inside it
is sent as it is; the answer's usage says what was applied (JSON, stream, Workers AI,
Responses), and a replay from the cache says it again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig
from tests.conftest import gateway_config

pytestmark = pytest.mark.slow

DEFAULT, CAP = 6, 10
POLICY = f"""
version = 1
[tiers.disk]
dir = "cache"
[routes.chat.max_tokens]
default = {DEFAULT}
[routes.responses.max_tokens]
default = {DEFAULT}
[models."tiny-chat".max_tokens]
cap = {CAP}
"""


def note(usage: Any) -> tuple[Any, Any]:
    extra = usage if isinstance(usage, dict) else usage.model_extra
    return extra.get("max_tokens_applied"), extra.get("max_tokens_source")


def test_the_policy_bounds_answers_and_their_usage_says_so(
    tiny_vllm: VllmProcess,
    data_dir: Path,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    config = gateway_config(
        tmp_path / "data",
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        policy=str(tmp_path / "policy.toml"),
    )
    gw = start_gateway(config)
    client = OpenAI(base_url=f"{gw.url}/v1", api_key="a-tenant", max_retries=0)
    ask: dict[str, Any] = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "temperature": 0,
    }

    miss = client.chat.completions.with_raw_response.create(**ask)
    answer = miss.parse()
    assert miss.headers["cf-aig-cache-status"] == "MISS"
    assert note(answer.usage) == (DEFAULT, "default")
    assert answer.usage.completion_tokens <= DEFAULT
    hit = client.chat.completions.with_raw_response.create(**ask)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert note(hit.parse().usage) == (DEFAULT, "default")  # replayed with its note

    capped = client.chat.completions.create(**ask, max_tokens=500)
    assert note(capped.usage) == (CAP, "cap") and capped.usage.completion_tokens <= CAP
    own = client.chat.completions.create(**ask, max_completion_tokens=3)
    assert note(own.usage) == (None, None) and own.usage.completion_tokens <= 3

    chunks = list(
        client.chat.completions.create(
            **{**ask, "messages": [{"role": "user", "content": "Another story, streamed."}]},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and note(usage) == (DEFAULT, "default")
    assert usage.completion_tokens <= DEFAULT

    response = client.responses.create(
        model="tiny-chat", input="One more story.", temperature=0, store=False
    )
    assert response.usage is not None and note(response.usage) == (DEFAULT, "default")
    assert response.usage.output_tokens <= DEFAULT

    run = f"{gw.url}/client/v4/accounts/acc/ai/run/@cf/test/tiny"
    body = {"prompt": "A Workers AI story.", "temperature": 0}
    with httpx.Client(headers={"authorization": "Bearer a-tenant"}, timeout=120) as http:
        result = http.post(run, json=body).json()["result"]
        # the policy's default comes before Workers AI's own 256
        assert note(result["usage"]) == (DEFAULT, "default")
        assert result["usage"]["completion_tokens"] <= DEFAULT
        stream = http.post(run, json={**body, "stream": True}).text
    events = [orjson.loads(line[6:]) for line in stream.splitlines() if line[6:7] == "{"]
    assert note(events[-1]["usage"]) == (DEFAULT, "default")
