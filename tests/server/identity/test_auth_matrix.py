"""Every route by {no token, unknown token, right token, admin token}, and each tenant's
objects (files, batches, cached answers, Workers-AI batches) hidden from the others, on
the app ``semcache serve`` builds."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry, exposure_problem
from tests.support.headers import bearer

TOKENS = {"acme": "tok-acme", "globex": "tok-globex", "ops": "tok-ops"}
PUBLIC = {"/", "/health", "/ready", "/metrics"}
DASHBOARD_PUBLIC = {"/dashboard", "/dashboard/login", "/dashboard/static/x"}
API_DOCS = {"/openapi.json", "/openapi.json/openapi.json", "/openapi.json/x", "/docs", "/docs/x"}
"""The API document and its UI (server/apidoc/document.py)."""


@pytest.fixture
def app(embedder: LocalEmbeddingBackend, tmp_path: Path) -> Litestar:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    tokens = [
        TokenEntry(token=TOKENS["acme"], tenant="acme", name="acme-1"),
        TokenEntry(token=TOKENS["globex"], tenant="globex"),
        TokenEntry(token=TOKENS["ops"], tenant="ops", roles=["admin"]),
    ]
    config = GatewayConfig(data_dir=str(tmp_path), auth=AuthSettings(tokens=tokens))
    return create_app(config, registry=reg)


@pytest.fixture
def client(app: Litestar) -> Iterator[TestClient[Any]]:
    with TestClient(app) as c:
        yield c


def operations(app: Litestar) -> list[tuple[str, str, str]]:
    """``(method, concrete path, auth need)`` of every route the app registers."""
    out = []
    for route in app.routes:
        assert isinstance(route, HTTPRoute), route
        path = re.sub(
            r"\{(\w+):\w+\}", lambda m: "chat-model" if m[1] == "model" else "x", route.path
        )
        for handler in route.route_handlers:
            for method in sorted(handler.http_methods - {"HEAD", "OPTIONS"}):
                out.append((method, path, str(handler.opt.get("auth", "token"))))
    return out


def refused_in_own_format(r: Any, path: str, status: int) -> None:
    assert r.status_code == status, (path, r.status_code, r.text)
    if path.startswith("/dashboard/") and "/api/" not in path:
        assert "text/html" in r.headers["content-type"]  # the login page, with the reason
        return
    body = r.json()
    if path.startswith("/client/v4"):
        assert body["success"] is False and body["errors"][0]["message"], body
    elif path.startswith("/v1/messages"):  # Anthropic's shape
        assert body["type"] == "error" and body["error"]["message"], body
        if status == 401:
            assert body["error"]["type"] == "authentication_error", body
    else:
        assert body["error"]["message"], body
        if status == 401:
            assert body["error"]["code"] == "invalid_api_key", body
            assert r.headers["www-authenticate"] == "Bearer"


def test_every_route_needs_a_listed_token(app: Litestar, client: TestClient[Any]) -> None:
    ops = operations(app)
    assert len(ops) >= 25  # the OpenAI, Workers-AI, admin and health routes
    for method, path, need in ops:
        if path in PUBLIC:
            assert need == "public"
            assert client.request(method, path).status_code in (200, 503), path
            continue
        if path in DASHBOARD_PUBLIC:  # the login form, its static files
            assert need == "public", path
            continue
        if path in API_DOCS:
            assert need == "public", path
            continue
        refused_in_own_format(client.request(method, path), path, 401)
        unknown = {"authorization": "Bearer not-a-listed-token"}
        refused_in_own_format(client.request(method, path, headers=unknown), path, 401)
        as_tenant = client.request(method, path, headers=bearer(TOKENS["acme"]), json={})
        if need in ("admin", "self"):  # "self": the dashboard, admin only
            refused_in_own_format(as_tenant, path, 403)
            # the purge form's header
            admin = {**bearer(TOKENS["ops"]), "x-semcache-dashboard": "1"}
            as_admin = client.request(method, path, headers=admin, json={})
            assert as_admin.status_code not in (401, 403), (path, as_admin.text)
        else:
            assert as_tenant.status_code not in (401, 403), (method, path, as_tenant.text)


def upload(client: TestClient[Any], tenant: str) -> str:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}
    line["body"] = {"model": "embed-model", "input": "hello"}  # type: ignore[assignment]
    files = {"file": ("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"))}
    r = client.post(
        "/v1/files", files=files, data={"purpose": "batch"}, headers=bearer(TOKENS[tenant])
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_a_tenant_sees_only_its_own_objects(client: TestClient[Any]) -> None:
    file_id = upload(client, "acme")
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        headers=bearer(TOKENS["acme"]),
    )
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    chat = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
    answer = client.post(
        "/v1/chat/completions", json={**chat, "temperature": 0}, headers=bearer(TOKENS["acme"])
    )
    cached = answer.headers["content-location"]
    wai = "/client/v4/accounts/acc/ai/run/@cf/test/chat"
    queued = client.post(
        wai + "?queueRequest=true",
        json={"requests": [{"prompt": "hi"}]},
        headers=bearer(TOKENS["acme"]),
    )
    assert queued.status_code == 200, queued.text
    request_id = queued.json()["result"]["request_id"]
    for method, path, body in [
        ("GET", f"/v1/files/{file_id}", None),
        ("GET", f"/v1/files/{file_id}/content", None),
        ("GET", f"/v1/batches/{batch_id}", None),
        ("POST", f"/v1/batches/{batch_id}/cancel", None),
        ("GET", cached, None),
        ("POST", wai, {"request_id": request_id}),
    ]:
        theirs = client.request(method, path, headers=bearer(TOKENS["globex"]), json=body)
        refused_in_own_format(theirs, path, 404)
        mine = client.request(method, path, headers=bearer(TOKENS["acme"]), json=body)
        assert mine.status_code == 200, (path, mine.text)
    listed = client.get("/v1/files", headers=bearer(TOKENS["globex"])).json()["data"]
    assert listed == []
    assert (
        client.delete(f"/v1/files/{file_id}", headers=bearer(TOKENS["globex"])).status_code == 404
    )


def test_one_token_is_one_tenant_on_every_route(client: TestClient[Any]) -> None:
    chat = {"model": "chat-model", "messages": [{"role": "user", "content": "same"}]}
    assert (
        client.post("/v1/chat/completions", json=chat, headers=bearer(TOKENS["acme"])).status_code
        == 200
    )
    wai = "/client/v4/accounts/acc/ai/run/@cf/test/chat"
    assert (
        client.post(wai, json={"prompt": "same"}, headers=bearer(TOKENS["acme"])).status_code == 200
    )
    logs = client.get(
        "/admin/logs", headers=bearer(TOKENS["ops"]), params={"tenant": "acme"}
    ).json()
    routes = {line["route"] for line in logs["data"]}
    assert "/v1/chat/completions" in routes
    assert any(r.startswith("/client/v4/accounts") for r in routes)
    assert {line["token"] for line in logs["data"]} == {"acme-1"}
    assert all(TOKENS["acme"] not in json.dumps(line) for line in logs["data"])


def test_the_admin_token_variable_is_an_admin(
    embedder: LocalEmbeddingBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SEMCACHE_ADMIN_TOKEN", "policy-admin")
    reg = ModelRegistry()
    app = create_app(GatewayConfig(data_dir=str(tmp_path)), registry=reg)  # open gateway
    with TestClient(app) as c:
        purge = {"kind": "all"}
        assert c.post("/admin/cache/purge", json=purge).status_code == 401
        r = c.post("/admin/cache/purge", json=purge, headers={"authorization": "Bearer key-1"})
        refused_in_own_format(r, "/admin/cache/purge", 403)
        ok = c.post(
            "/admin/cache/purge", json=purge, headers={"authorization": "Bearer policy-admin"}
        )
        assert ok.status_code == 200, ok.text


def test_an_open_gateway_stays_on_loopback_unless_told() -> None:
    assert exposure_problem(AuthSettings(), "127.0.0.1") is None
    assert exposure_problem(AuthSettings(), "::1") is None
    assert exposure_problem(AuthSettings(), "localhost") is None
    problem = exposure_problem(AuthSettings(), "0.0.0.0")
    assert problem is not None and "open = true" in problem
    assert exposure_problem(AuthSettings(open=True), "0.0.0.0") is None
    listed = AuthSettings(tokens=[TokenEntry(token="t", tenant="a")])
    assert exposure_problem(listed, "10.0.0.5") is None
