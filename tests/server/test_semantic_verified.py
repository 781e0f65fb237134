"""Verified chat semantic caching through the ``semcache serve`` process (real tiny vLLM).

The tiny model has random weights, so its answers to two paraphrases seldom agree: the
``embedding`` judge with a bound of 0 accepts every answer (the partition learns that its
entries are always right), the ``exact`` judge compares the answers as they are, the
``model`` judge asks the tiny model itself (its reply held to yes or no by vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.vllm_process import TINY_MODEL_NAME
from server.config import ModelEntry
from tests.conftest import gateway_config
from tests.server.test_semantic_http import chat
from tests.support.configs import admin_auth, verified_rule

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
POLICY = (
    """
version = 1
[tiers.disk]
dir = "cache/exact"
"""
    + verified_rule("tiny-learns")
    + verified_rule("tiny-learns-default")
    + """
[models."tiny-exact".routes.chat.semantic]
mode = "verified"
threshold = 0.6
min_threshold = 0.6
explores_per_minute = 2
[models."tiny-judged".routes.chat.semantic]
mode = "verified"
threshold = 0.6
min_threshold = 0.6
judge = "model"
judge_model = "tiny-chat"
# A request that names no max_tokens gets this default, noted in its answer and its key.
[routes.chat.max_tokens]
default = 8
"""
)
QUESTION = "What is the capital of France?"
PARAPHRASES = [
    "what is the capital of france",
    "What's the capital of France?",
    "what is the capital city of france?",
    "Which city is the capital of France?",
    "tell me the capital of France",
    "What is France's capital?",
    "capital of france?",
    "What is the capital of France, please?",
]


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_vllm: VllmProcess
) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("semantic-verified")
    (tmp / "policy.toml").write_text(POLICY)
    model = data_dir / "models" / TINY_MODEL_NAME
    cfg = gateway_config(
        tmp, tiny_vllm.url, model, policy=str(tmp / "policy.toml"), auth=admin_auth(ADMIN)
    )
    cfg.models += [
        ModelEntry(id="tiny-learns", backend="tiny", task="chat"),
        ModelEntry(id="tiny-learns-default", backend="tiny", task="chat"),
        ModelEntry(id="tiny-exact", backend="tiny", task="chat"),
        ModelEntry(id="tiny-judged", backend="tiny", task="chat"),
    ]
    gw = GatewayProcess(write_config_toml(cfg, tmp / "gateway.toml")).start()
    try:
        yield gw
    finally:
        gw.stop()


def decision(r: httpx.Response) -> str | None:
    return r.headers.get("x-semcache-semantic")


def counter(gw: GatewayProcess, model: str, event: str) -> float:
    return metric(gw, f'semcache_semantic_verified_total{{event="{event}",model="{model}"}}')


def metric(gw: GatewayProcess, name: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=30).text
    prefix = f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.removeprefix(prefix))
    return 0.0


@pytest.mark.parametrize(
    ("model", "max_tokens"), [("tiny-learns", 8), ("tiny-learns-default", None)]
)
def test_a_verified_partition_explores_learns_then_serves_and_forgets_on_purge(
    gw: GatewayProcess, model: str, max_tokens: int | None
) -> None:
    """With and without ``max_tokens`` (the policy's default, noted in the key)."""
    first = chat(gw, model, QUESTION, max_tokens=max_tokens)
    assert decision(first) is None  # nothing cached yet: a plain miss
    seen = [decision(chat(gw, model, text, max_tokens=max_tokens)) for text in PARAPHRASES[:3]]
    assert seen == ["explore"] * 3  # below min_observations: every candidate is explored
    hit = chat(gw, model, PARAPHRASES[3], max_tokens=max_tokens)
    assert decision(hit) == "hit"
    assert hit.json()["id"] == first.json()["id"]  # the cached answer itself
    assert counter(gw, model, "explore") == 3
    assert metric(gw, f'semcache_semantic_verified_total{{event="exploit",model="{model}"}}') == 1
    assert counter(gw, model, "judged_wrong") == 0

    r = httpx.post(
        f"{gw.url}/admin/cache/purge",
        json={"kind": "model", "target": model},
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    chat(gw, model, QUESTION, max_tokens=max_tokens)  # cached again, in a new partition
    assert decision(chat(gw, model, PARAPHRASES[4], max_tokens=max_tokens)) == "explore"


def test_exact_judge_and_the_explore_cap(gw: GatewayProcess) -> None:
    chat(gw, "tiny-exact", QUESTION)
    seen = [decision(chat(gw, "tiny-exact", text)) for text in PARAPHRASES[:4]]
    # Two judged explores a minute; then the partition's requests are plain misses.
    assert seen[:2] == ["explore", "explore"]
    assert counter(gw, "tiny-exact", "explore") == 2
    assert counter(gw, "tiny-exact", "capped") >= 1
    assert "hit" not in seen  # min_observations (10) is far away


def test_the_model_judge_asks_a_configured_chat_model(gw: GatewayProcess) -> None:
    """``judge = "model"`` asks tiny-chat, through its backend, whether the answers agree.
    The tiny model's random weights would ramble; vLLM's structured outputs hold its reply
    to yes or no, so every explore gets a verdict (which one, the random weights decide)."""
    tokens = 'semcache_tokens_total{kind="prompt",model="tiny-chat"}'
    before = metric(gw, tokens)
    chat(gw, "tiny-judged", QUESTION)
    seen = [decision(chat(gw, "tiny-judged", text)) for text in PARAPHRASES[:2]]
    assert seen == ["explore"] * 2  # below min_observations (10): every candidate
    assert counter(gw, "tiny-judged", "explore") == 2
    assert counter(gw, "tiny-judged", "unjudged") == 0
    right, wrong = (counter(gw, "tiny-judged", f"judged_{v}") for v in ("right", "wrong"))
    assert right + wrong == 2
    # The judge's calls, counted as tiny-chat's traffic: two prompts of a hundred tokens or
    # so (the question and both answers), not the explored requests' own (tiny-judged's).
    assert metric(gw, tokens) - before >= 2 * 50
