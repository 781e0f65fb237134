"""The Tenants page lists each token's limits and what remains; the Batches page the queue."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from server.limits.settings import LimitSettings
from tests.support.waiting import wait_until

CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_the_tenants_page_shows_what_remains(tmp_path: Path) -> None:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    limits = LimitSettings(requests_per_minute=5, daily_tokens=1000)
    tokens = [
        TokenEntry(token="tok-acme", tenant="acme", name="acme-1", limits=limits),
        TokenEntry(token="tok-ops", tenant="ops", roles=["admin"], name="ops"),
    ]
    config = GatewayConfig(data_dir=str(tmp_path), auth=AuthSettings(tokens=tokens))
    with TestClient(create_app(config, registry=reg)) as client:
        for _ in range(2):  # a miss (4 tokens), then a hit (spends no budget)
            r = client.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer tok-acme"}
            )
            assert r.status_code == 200

        def acme() -> dict[str, Any]:
            page = client.get("/dashboard/api/tenants", headers={"authorization": "Bearer tok-ops"})
            assert page.status_code == 200, page.text
            (row,) = [t for t in page.json()["limits"] if t["token"] == "acme-1"]
            return row

        wait_until(lambda: acme()["budgets"][0]["tokens_spent"] == 4)
        row = acme()
        assert (row["requests_per_minute"], row["requests_remaining"]) == (5, 3)
        assert row["budgets"] == [
            {"period": "day", "tokens": 1000, "tokens_spent": 4, "usd": None, "usd_spent": 0.0}
        ]
        html = client.get("/dashboard/tenants", headers={"authorization": "Bearer tok-ops"}).text
        assert "3 of 5" in html and "4 of 1,000 tokens" in html


def test_the_batches_page_shows_the_queue(tmp_path: Path) -> None:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    tokens = [TokenEntry(token="tok-ops", tenant="ops", roles=["admin"], name="ops")]
    config = GatewayConfig(data_dir=str(tmp_path), auth=AuthSettings(tokens=tokens))
    ops = {"authorization": "Bearer tok-ops"}
    with TestClient(create_app(config, registry=reg)) as client:
        run = "/client/v4/accounts/a/ai/run/@cf/test/chat?queueRequest=true"
        queued = client.post(
            run, json={"requests": [{"prompt": "a"}, {"prompt": "b"}]}, headers=ops
        )
        assert queued.status_code == 200, queued.text

        def queue() -> dict[str, Any]:
            data: dict[str, Any] = client.get("/dashboard/api/batches", headers=ops).json()["queue"]
            return data

        wait_until(lambda: queue()["items"] == 0)  # both items ran: nothing left unfinished
        assert queue() == {"items": 0, "leased": 0, "oldest_age_s": None}
        assert "Queue: unfinished items" in client.get("/dashboard/batches", headers=ops).text
