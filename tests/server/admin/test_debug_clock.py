"""``/admin/debug/clock`` through the app: only with ``[debug] adjustable_clock``, admin only,
and the answer cache's entries age by the moved clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import DebugSettings, GatewayConfig
from tests.support.configs import admin_auth

Client = TestClient[Any]
ADMIN = "clock-admin"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def app_config(tmp_path: Path, adjustable: bool) -> GatewayConfig:
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults]\nttl_s = 60\nswr_s = 0\n")
    return GatewayConfig(
        data_dir=str(tmp_path),
        policy=str(policy),
        auth=admin_auth(ADMIN),
        debug=DebugSettings(adjustable_clock=adjustable),
    )


def registry_with(fake: FakeGeneration) -> ModelRegistry:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    return reg


@pytest.fixture
def client(fake: FakeGeneration, tmp_path: Path) -> Iterator[Client]:
    with TestClient(create_app(app_config(tmp_path, True), registry=registry_with(fake))) as c:
        yield c


def ask(client: Client) -> str:
    body = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": "what time is it?"}],
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer t"})
    assert r.status_code == 200, r.text
    return str(r.headers["cf-aig-cache-status"])


def test_a_moved_clock_expires_the_cached_answer(client: Client, fake: FakeGeneration) -> None:
    assert [ask(client), ask(client)] == ["MISS", "HIT"]
    moved = client.post("/admin/debug/clock", json={"advance_s": 59}, headers=ADMIN_HEADERS)
    assert moved.status_code == 200, moved.text
    assert 58.9 < moved.json()["offset_s"] < 59.1 and moved.json()["frozen"] is False
    assert ask(client) == "HIT"  # 59 s old: within its 60 s TTL
    client.post("/admin/debug/clock", json={"advance_s": 2}, headers=ADMIN_HEADERS)
    assert ask(client) == "EXPIRED"
    assert len(fake.calls) == 2  # the miss and the expired one


def test_frozen_the_clock_reads_one_instant(client: Client) -> None:
    frozen = client.post("/admin/debug/clock", json={"freeze": True}, headers=ADMIN_HEADERS)
    assert frozen.status_code == 200 and frozen.json()["frozen"] is True
    again = client.get("/admin/debug/clock", headers=ADMIN_HEADERS).json()
    assert again["now"] == frozen.json()["now"]
    moved = client.post(
        "/admin/debug/clock", json={"advance_s": 3600, "freeze": False}, headers=ADMIN_HEADERS
    ).json()
    # thawed: it runs on from the frozen reading, moved by an hour
    assert 0 <= moved["now"] - (frozen.json()["now"] + 3600) < 1 and moved["frozen"] is False


def test_only_an_admin_reads_or_moves_it_and_bad_bodies_are_400(client: Client) -> None:
    assert client.get("/admin/debug/clock").status_code == 401
    tenant = {"authorization": "Bearer some-tenant"}
    assert client.post("/admin/debug/clock", json={}, headers=tenant).status_code in (401, 403)
    bad = client.post("/admin/debug/clock", json={"advance_s": "soon"}, headers=ADMIN_HEADERS)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_without_the_setting_the_routes_do_not_exist(fake: FakeGeneration, tmp_path: Path) -> None:
    app = create_app(app_config(tmp_path, False), registry=registry_with(fake))
    with TestClient(app) as c:
        assert c.get("/admin/debug/clock", headers=ADMIN_HEADERS).status_code == 404
        assert c.post("/admin/debug/clock", json={}, headers=ADMIN_HEADERS).status_code == 404
