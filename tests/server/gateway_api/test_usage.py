"""GET /v1/usage through the app: the ledger's sums of what the clients received, scoped by
tenant, with errors in OpenAI's format."""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from semcache.ledger import utc_day
from semcache.ledger.redis import RedisStorage
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import tenant_from
from tests.semcache.conftest import RedisServer
from tests.support.configs import admin_auth
from tests.support.headers import bearer
from tests.support.waiting import wait_until

Client = TestClient[Any]
ADMIN = "usage-admin"
INPUT_PER_M, OUTPUT_PER_M = 0.045, 0.384


@pytest.fixture
def client(
    fake: FakeGeneration, embedder: LocalEmbeddingBackend, tmp_path: Path
) -> Iterator[Client]:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", (), "t", "minilm", "r", "n"))
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[models."chat-model"]\n'
        f"prices = {{ input_per_m = {INPUT_PER_M}, output_per_m = {OUTPUT_PER_M} }}\n"
    )
    config = GatewayConfig(data_dir=str(tmp_path), policy=str(policy), auth=admin_auth(ADMIN))
    with TestClient(create_app(config, registry=reg)) as c:
        yield c


def send(client: Client, token: str, totals: dict[str, int]) -> None:
    """A chat miss and hit, an embeddings miss and hit; adds the usage the client got."""
    for _ in range(2):
        chat = {"model": "chat-model", "messages": [{"role": "user", "content": token}]}
        r = client.post(
            "/v1/chat/completions", json={**chat, "temperature": 0}, headers=bearer(token)
        )
        assert r.status_code == 200
        emb = {"model": "embed-model", "input": f"the usage of {token}"}
        e = client.post("/v1/embeddings", json=emb, headers=bearer(token))
        assert e.status_code == 200
        for usage in (r.json()["usage"], e.json()["usage"]):
            totals["requests"] += 1
            totals["prompt_tokens"] += usage["prompt_tokens"]
            totals["completion_tokens"] += usage.get("completion_tokens", 0)


def fresh() -> dict[str, int]:
    return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}


def usage(client: Client, token: str, **query: str) -> Any:
    return client.get("/v1/usage", params=query, headers=bearer(token))


def test_the_ledger_sums_what_the_clients_received(client: Client) -> None:
    alice, bob = fresh(), fresh()
    send(client, "alice-key", alice)
    send(client, "bob-key", bob)
    send(client, "bob-key", bob)  # hits only

    r = usage(client, "alice-key", group_by="tenant,model")
    assert r.status_code == 200 and r.json()["object"] == "list"
    rows = r.json()["data"]
    assert {row["tenant"] for row in rows} == {tenant_from(bearer("alice-key"))}  # her own only
    assert sum(row["requests"] for row in rows) == alice["requests"]
    assert sum(row["prompt_tokens"] for row in rows) == alice["prompt_tokens"]
    chat = next(row for row in rows if row["model"] == "chat-model")
    assert (chat["requests"], chat["exact_hits"]) == (2, 1)
    # the miss cost its tokens at the policy's prices; the hit saved as much
    cost = (3 * INPUT_PER_M + 1 * OUTPUT_PER_M) / 1e6
    assert chat["cost_usd"] == pytest.approx(cost) and chat["saved_usd"] == pytest.approx(cost)
    assert chat["tokens_saved"] == 4

    everyone = usage(client, ADMIN, group_by="tenant").json()["data"]
    assert [(row["tenant"], row["requests"]) for row in everyone] == sorted(
        [
            (tenant_from(bearer("alice-key")), alice["requests"]),
            (tenant_from(bearer("bob-key")), bob["requests"]),
        ]
    )
    (total,) = usage(client, ADMIN, group_by="").json()["data"]
    for field in ("requests", "prompt_tokens", "completion_tokens"):
        assert total[field] == alice[field] + bob[field], field
    assert set(total) == {
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "exact_hits",
        "semantic_hits",
        "tokens_saved",
        "cost_usd",
        "saved_usd",
        "prefix_cached_tokens",
        "prefix_saved_usd",
    }
    # today (UTC) is the default range's end; an admin may look at one tenant
    (day,) = usage(client, ADMIN, group_by="day", tenant=tenant_from(bearer("bob-key"))).json()[
        "data"
    ]
    assert day["day"] == utc_day(time.time()) and day["requests"] == bob["requests"]


@pytest.mark.parametrize(
    ("query", "param", "message"),
    [
        ({"start": "2026-13-01"}, "start", "is not a date"),
        ({"end": "soon"}, "end", "expected a date YYYY-MM-DD"),
        ({"group_by": "tenant,week"}, "group_by", "unknown field"),
        ({"start": "2026-12-02", "end": "2026-12-01"}, None, "is after end"),
    ],
)
def test_bad_queries_are_400s_in_openai_format(
    client: Client, query: dict[str, str], param: str | None, message: str
) -> None:
    r = usage(client, "alice-key", **query)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_a_tenant_cannot_read_another_tenants_usage(client: Client) -> None:
    r = usage(client, "alice-key", tenant=tenant_from(bearer("bob-key")))
    assert r.status_code == 403 and r.json()["error"]["param"] == "tenant"
    mine = usage(client, "alice-key", tenant=tenant_from(bearer("alice-key")))
    assert mine.status_code == 200 and mine.json()["data"] == []


def test_batch_items_count_under_the_batch_route(client: Client) -> None:
    texts = ["a batch line", "another batch line"]
    expected = 0
    for text in texts:  # the same inputs live: the usage a batch output line reports
        e = client.post("/v1/embeddings", json={"model": "embed-model", "input": text})
        expected += e.json()["usage"]["prompt_tokens"]
    lines = [
        {
            "custom_id": str(i),
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "embed-model", "input": text},
        }
        for i, text in enumerate(texts)
    ]
    jsonl = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    up = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", io.BytesIO(jsonl))},
        data={"purpose": "batch"},
        headers=bearer("alice-key"),
    )
    body = {"input_file_id": up.json()["id"], "endpoint": "/v1/embeddings"}
    batch = client.post(
        "/v1/batches", json={**body, "completion_window": "24h"}, headers=bearer("alice-key")
    )
    assert batch.status_code == 200, batch.text

    def items() -> list[dict[str, Any]]:
        rows = usage(client, "alice-key", group_by="route").json()["data"]
        return [row for row in rows if row["route"] == "batch"]

    wait_until(lambda: items() and items()[0]["requests"] == len(texts), timeout_s=60)
    (row,) = items()
    assert row["prompt_tokens"] == expected and row["completion_tokens"] == 0


@pytest.mark.slow
def test_two_gateways_on_one_redis_share_one_ledger(
    embedder: LocalEmbeddingBackend, tmp_path: Path, redis_server: RedisServer
) -> None:
    """With Redis in the policy (storage "auto"), each gateway's usage adds into one ledger."""
    prefix = f"u{uuid.uuid4().hex[:8]}"
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[tiers.redis]\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n')

    def gateway(name: str) -> Client:
        reg = ModelRegistry()
        reg.embedding["minilm"] = embedder
        reg.add(ModelInfo("embed-model", "embeddings", (), "t", "minilm", "r", "n"))
        config = GatewayConfig(data_dir=str(tmp_path / name), policy=str(policy))
        return TestClient(create_app(config, registry=reg))

    sent = 0
    with gateway("a") as a, gateway("b") as b:
        assert isinstance(a.app.state.ledger.storage, RedisStorage)
        for i, client in enumerate((a, b, a)):
            e = client.post(
                "/v1/embeddings",
                json={"model": "embed-model", "input": f"gateway text {i}"},
                headers=bearer("alice-key"),
            )
            sent += e.json()["usage"]["prompt_tokens"]
        # each gateway counts its own usage at once, the other's once that one has flushed
        # (every second)
        for client in (a, b):

            def total(c: Client = client) -> Any:
                (row,) = usage(c, "alice-key", group_by="").json()["data"]
                return row

            wait_until(lambda: total()["requests"] == 3, timeout_s=10)
            row = total()
            assert (row["requests"], row["prompt_tokens"]) == (3, sent)
