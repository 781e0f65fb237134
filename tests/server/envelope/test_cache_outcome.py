"""One cache outcome per request, read the same by every reader: the headers, the request
log, ``/metrics``, the usage ledger and the limits, on the app ``semcache serve`` builds.
A partial answer (some items from the cache) is no hit anywhere; its cached items are saved
tokens everywhere (docs/cache.md, "One cache outcome")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from foundation.request import CacheOutcome
from harness.fake_vllm import FakeGeneration
from harness.metrics import parse_metric
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from tests.support.waiting import wait_until

ACME = {"authorization": "Bearer tok-acme"}
OPS = {"authorization": "Bearer tok-ops"}
POLICY = """
version = 1
[models."chat-model"]
prices = { input_per_m = 1.0, output_per_m = 2.0, cached_input_per_m = 0.25 }
[models."embed-model"]
prices = { input_per_m = 1.0 }
[routes.embeddings.semantic]
enabled = true
threshold = 0.95
min_threshold = 0.9
"""
TEXTS = ["The river flows through the old town.", "A completely different sentence here."]


def test_outcome_as_values() -> None:
    assert [o.value for o in CacheOutcome if o.hit] == ["exact", "stale", "semantic"]
    assert [o.value for o in CacheOutcome if o.exact] == ["exact", "stale"]
    assert not CacheOutcome.PARTIAL.hit and not CacheOutcome.BYPASS.hit


@pytest.fixture
def client(tmp_path: Path, embedder: LocalEmbeddingBackend) -> Any:
    (tmp_path / "policy.toml").write_text(POLICY)
    fake = FakeGeneration()
    fake.prefix_cached = 2
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    tokens = [
        TokenEntry(token="tok-acme", tenant="acme"),
        TokenEntry(token="tok-ops", tenant="ops", roles=["admin"], name="ops"),
    ]
    config = GatewayConfig(
        data_dir=str(tmp_path),
        auth=AuthSettings(tokens=tokens),
        policy=str(tmp_path / "policy.toml"),
    )
    with TestClient(create_app(config, registry=reg)) as c:
        yield c


def outcomes(client: Any, route: str) -> dict[str, float]:
    text = client.get("/metrics").text
    assert "semcache_request_cache_outcomes_total{" in text
    return {
        o.value: parse_metric(
            text, "semcache_request_cache_outcomes_total", {"route": route, "outcome": o.value}
        )
        for o in CacheOutcome
    }


def test_every_reader_counts_the_outcome_the_headers_state(client: Any) -> None:
    chat = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
    }
    miss = client.post("/v1/chat/completions", json=chat, headers=ACME)
    hit = client.post("/v1/chat/completions", json=chat, headers=ACME)
    skip = client.post(
        "/v1/chat/completions", json=chat, headers={**ACME, "cache-control": "no-cache"}
    )
    said = [r.headers["cf-aig-cache-status"] for r in (miss, hit, skip)]
    assert said == ["MISS", "HIT", "BYPASS"]

    embed = "/v1/embeddings"
    first = client.post(embed, json={"model": "embed-model", "input": TEXTS[0]}, headers=ACME)
    # the model is uncased: the upper-case text is a near-duplicate with the same vector
    both = [TEXTS[0].upper(), TEXTS[1]]
    partial = client.post(embed, json={"model": "embed-model", "input": both}, headers=ACME)
    whole = client.post(
        embed, json={"model": "embed-model", "input": TEXTS[1].upper()}, headers=ACME
    )
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert partial.headers["x-semcache-semantic"] == "partial"
    assert whole.headers["x-semcache-semantic"] == "hit"

    log = client.get("/admin/logs", params={"tenant": "acme"}, headers=OPS).json()["data"]
    assert [line["cache"] for line in reversed(log)] == [
        "miss",
        "exact",
        "bypass",
        "miss",
        "partial",
        "semantic",
    ]
    chat_counts = outcomes(client, "/v1/chat/completions")
    assert (chat_counts["miss"], chat_counts["exact"], chat_counts["bypass"]) == (1, 1, 1)
    embed_counts = outcomes(client, "/v1/embeddings")
    assert (embed_counts["miss"], embed_counts["partial"], embed_counts["semantic"]) == (1, 1, 1)
    semantic_hits = parse_metric(
        client.get("/metrics").text, "semcache_semantic_hits_total", {"model": "embed-model"}
    )
    assert semantic_hits == 1  # the partial answer is no hit

    def ledger() -> dict[str, dict[str, Any]]:
        r = client.get("/v1/usage", params={"group_by": "model"}, headers=ACME)
        assert r.status_code == 200, r.text
        return {row["model"]: row for row in r.json()["data"]}

    wait_until(lambda: ledger().get("embed-model", {}).get("requests") == 3, timeout_s=10)
    rows = ledger()
    chat_row, embed_row = rows["chat-model"], rows["embed-model"]
    assert (chat_row["exact_hits"], chat_row["semantic_hits"]) == (1, 0)
    assert (embed_row["exact_hits"], embed_row["semantic_hits"]) == (0, 1)
    # saved: the partial answer's cached item (the first text's tokens) and the whole hit's
    cached_item, whole_hit = (r.json()["usage"]["prompt_tokens"] for r in (first, whole))
    assert embed_row["tokens_saved"] == cached_item + whole_hit
    # Prefix-cache tokens of the two computed answers (2 of 3 prompt tokens each), priced at
    # the cached input price: 2 * (1 * 1.0 + 2 * 0.25 + 1 * 2.0) per million.
    assert chat_row["prefix_cached_tokens"] == 4
    assert chat_row["cost_usd"] == pytest.approx(2 * 3.5e-6)
    assert chat_row["prefix_saved_usd"] == pytest.approx(4 * 0.75e-6)
