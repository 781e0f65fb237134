"""The dashboard's pages and JSON through the app ``create_app`` builds (a fake chat backend):
the admin token, the cookie of the login form, the purge's guard. The browser test is
``test_browser.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.dashboard.formats import DASH
from server.dashboard.pages import PAGES
from server.envelope.request_log import RequestLogSettings

ADMIN = "dash-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_ADMIN_TOKEN", ADMIN)


def chat(client: TestClient[Any], text: str) -> None:
    body = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_without_the_token_every_page_is_a_401_page_and_no_data(client: TestClient[Any]) -> None:
    chat(client, "a secret question")
    for page in PAGES:
        answer = client.get(f"/dashboard/{page}")
        assert answer.status_code == 401
        assert "Admin token" in answer.text and "chat-model" not in answer.text
        assert client.get(f"/dashboard/api/{page}").status_code == 401
        wrong = client.get(f"/dashboard/{page}", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 403
    assert client.get("/dashboard/api/series/5m").status_code == 401
    assert client.post("/dashboard/api/purge", json={"kind": "all"}).status_code == 401


def test_pages_show_the_figures_of_their_json(client: TestClient[Any]) -> None:
    for text in ("one", "two", "one", "one"):
        chat(client, text)
    data = client.get("/dashboard/api/overview", headers=AUTH).json()
    assert data["totals"]["requests"] == 4
    assert data["totals"]["exact_hits"] == 2
    assert data["status"] == {"200": 4}
    page = client.get("/dashboard/overview", headers=AUTH)
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<dd id="requests">4</dd>' in page.text
    assert '<dd id="exact-hits">2</dd>' in page.text
    for name in PAGES:
        assert client.get(f"/dashboard/{name}", headers=AUTH).status_code == 200, name
        assert client.get(f"/dashboard/{name}?partial=1", headers=AUTH).text.lstrip()[:1] == "<"
    tenants = client.get("/dashboard/api/tenants", headers=AUTH).json()
    models = {m["model"]: m for m in tenants["models"]}
    assert models["chat-model"]["tokens"] > 0
    requests = client.get("/dashboard/api/requests", headers=AUTH).json()
    assert {"route": "/v1/chat/completions", "status": "200", "value": 4} in requests["by_route"]


def test_the_login_cookie_opens_the_pages_and_purges_need_the_dashboard_header(
    client: TestClient[Any],
) -> None:
    answer = client.post(
        "/dashboard/login",
        data={"token": ADMIN, "next": "/dashboard/cache"},
        follow_redirects=False,
    )
    assert answer.status_code == 303 and answer.headers["location"] == "/dashboard/cache"
    cookie = answer.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
    assert client.get("/dashboard/cache").status_code == 200
    assert client.post("/dashboard/api/purge", json={"kind": "all"}).status_code == 403
    purged = client.post(
        "/dashboard/api/purge", json={"kind": "all"}, headers={"x-semcache-dashboard": "1"}
    )
    assert purged.status_code == 200 and purged.json()["kind"] == "all"
    cache = client.get("/dashboard/api/cache").json()
    assert cache["purges_by_kind"] == {"all": 1}
    assert [p["kind"] for p in cache["recent_purges"]] == ["all"]


def test_the_request_log_shows_times_models_and_servers_as_such(client: TestClient[Any]) -> None:
    chat(client, "a logged question")
    assert client.get("/v1/models").status_code == 200  # a request that names no model
    logs = client.get("/admin/logs", headers=AUTH).json()["data"]
    page = client.get("/dashboard/requests?partial=1", headers=AUTH).text
    row = re.search(r'<tr data-request="[^"]+">.*?</tr>', page, re.S)
    assert row is not None and '<div class="scroll"><table id="log"' in page
    assert re.search(r'<td class="time">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d</td>', page)
    assert '<td class="model">chat-model</td>' in page
    assert f'<td class="model">{DASH}</td>' in page  # GET /v1/models
    served = [line for line in logs if line["servers"]]
    for line in served:
        assert f"<li>{line['servers'][0]}</li>" in page
    for raw in ("None", "['", str(int(logs[0]["time"]))):
        assert raw not in page, raw


def test_requests_counted_per_tenant_are_still_every_pages_requests(tmp_path: Path) -> None:
    """``[request_log] tenant_metrics`` counts requests in ``semcache_tenant_requests``
    instead: the overview and the requests page sum them over the tenants."""
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    config = GatewayConfig(
        data_dir=str(tmp_path), request_log=RequestLogSettings(tenant_metrics=True)
    )
    with TestClient(create_app(config, registry=reg)) as client:
        for tenant in ("tenant-a", "tenant-b"):
            body = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"authorization": f"Bearer {tenant}"}
            assert client.post("/v1/chat/completions", json=body, headers=headers).is_success
        data = client.get("/dashboard/api/overview", headers=AUTH).json()
        assert data["totals"]["requests"] == 2 and data["status"] == {"200": 2}
        requests = client.get("/dashboard/api/requests", headers=AUTH).json()
        assert {"route": "/v1/chat/completions", "status": "200", "value": 2} in requests[
            "by_route"
        ]
