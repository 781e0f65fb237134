"""API keys on the app ``semcache serve`` builds (a fake backend, for speed): the admin API,
and each refusal in its route's own format. The real-process proof is test_shared.py."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from server.limits.settings import LimitSettings
from tests.support.headers import bearer

ADMIN = {"authorization": "Bearer tok-ops"}
CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
WAI = "/client/v4/accounts/acc/ai/run/"


@pytest.fixture
def app(embedder: LocalEmbeddingBackend, tmp_path: Path) -> Litestar:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    tokens = [
        TokenEntry(token="tok-acme", tenant="acme", name="acme-prod"),
        TokenEntry(token="tok-ops", tenant="ops", roles=["admin"], name="ops"),
    ]
    config = GatewayConfig(
        data_dir=str(tmp_path),
        auth=AuthSettings(tokens=tokens),
        limits=LimitSettings(requests_per_minute=1000),
    )
    return create_app(config, registry=reg)


@pytest.fixture
def client(app: Litestar) -> Iterator[TestClient[Any]]:
    with TestClient(app) as c:
        yield c


def create(client: TestClient[Any], **fields: Any) -> tuple[str, str]:
    r = client.post("/admin/keys", json={"tenant": "acme", **fields}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["key"]["id"], body["secret"]


def test_a_key_made_by_an_admin_serves_its_tenant(client: TestClient[Any]) -> None:
    key_id, secret = create(client, name="ci", metadata={"team": "search"})
    assert secret.startswith(f"sk-sc-{key_id}-")
    r = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert r.status_code == 200, r.text
    shown = client.get(f"/admin/keys/{key_id}", headers=ADMIN).json()
    assert shown["tenant"] == "acme" and shown["status"] == "active"
    assert shown["metadata"] == {"team": "search"}
    assert "secret" not in shown and "digest" not in shown
    listed = client.get("/admin/keys", params={"tenant": "acme"}, headers=ADMIN).json()
    assert [k["id"] for k in listed["data"]] == [key_id]
    assert client.get("/admin/keys", params={"tenant": "zzz"}, headers=ADMIN).json()["data"] == []


def test_the_admin_api_needs_the_admin_role(client: TestClient[Any]) -> None:
    _, secret = create(client)
    for headers in (bearer(secret), {"authorization": "Bearer tok-acme"}):
        r = client.post("/admin/keys", json={"tenant": "acme"}, headers=headers)
        assert r.status_code == 403, r.text
        assert client.get("/admin/audit", headers=headers).status_code == 403
    admin_id, admin_secret = create(client, tenant="ops", roles=["admin"])
    r = client.post("/admin/keys", json={"tenant": "acme"}, headers=bearer(admin_secret))
    assert r.status_code == 200, r.text
    entry = client.get("/admin/audit", params={"limit": 1}, headers=ADMIN).json()["data"][0]
    assert entry["actor"] == f"key:{admin_id}" and entry["action"] == "create"


def test_revoked_and_expired_keys_are_401_in_each_format(client: TestClient[Any]) -> None:
    key_id, secret = create(client)
    expired_id, expired = create(client, expires_at=time.time() - 1)
    assert client.delete(f"/admin/keys/{key_id}", headers=ADMIN).json()["status"] == "revoked"
    for token, code, word in (
        (secret, "api_key_revoked", "revoked"),
        (expired, "api_key_expired", "expired"),
    ):
        r = client.post("/v1/chat/completions", json=CHAT, headers=bearer(token))
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == code and word in r.json()["error"]["message"]
        w = client.post(WAI + "@cf/test/chat", json={"prompt": "hi"}, headers=bearer(token))
        assert w.status_code == 401 and w.json()["success"] is False, w.text
        assert word in w.json()["errors"][0]["message"]
    assert client.get(f"/admin/keys/{expired_id}", headers=ADMIN).json()["status"] == "expired"
    unknown = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret + "x"))
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "invalid_api_key"


def test_a_model_scoped_key_is_refused_other_models_everywhere(client: TestClient[Any]) -> None:
    _, secret = create(client, models=["embed-model"])
    r = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "model_not_allowed"
    assert "`chat-model`" in r.json()["error"]["message"]
    ok = client.post(
        "/v1/embeddings", json={"model": "embed-model", "input": "x"}, headers=bearer(secret)
    )
    assert ok.status_code == 200, ok.text
    alias = client.post(WAI + "@cf/test/embed", json={"text": "x"}, headers=bearer(secret))
    assert alias.status_code == 200, alias.text  # an alias of an allowed model
    w = client.post(WAI + "@cf/test/chat", json={"prompt": "hi"}, headers=bearer(secret))
    assert w.status_code == 403 and w.json()["success"] is False, w.text
    assert "`@cf/test/chat`" in w.json()["errors"][0]["message"]
    queued = client.post(
        WAI + "@cf/test/chat?queueRequest=true",
        json={"requests": [{"prompt": "hi"}]},
        headers=bearer(secret),
    )
    assert queued.status_code == 403, queued.text
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    files = {"file": ("in.jsonl", io.BytesIO(data))}
    up = client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=bearer(secret))
    assert up.status_code == 200, up.text
    batch = client.post(
        "/v1/batches",
        json={
            "input_file_id": up.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=bearer(secret),
    ).json()
    assert batch["status"] == "failed", batch
    (error,) = batch["errors"]["data"]
    assert error["code"] == "model_not_allowed" and error["line"] == 1
    assert "`chat-model`" in error["message"]


def test_rotation_and_updates(client: TestClient[Any]) -> None:
    key_id, old = create(client)
    r = client.post(f"/admin/keys/{key_id}/rotate", json={"grace_s": 3600}, headers=ADMIN)
    assert r.status_code == 200, r.text
    new = r.json()["secret"]
    assert r.json()["key"]["previous_secret_valid_until"] is not None
    for secret in (old, new):
        assert (
            client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)).status_code
            == 200
        )
    r = client.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN)  # no grace
    newest = r.json()["secret"]
    assert client.post("/v1/chat/completions", json=CHAT, headers=bearer(new)).status_code == 401
    patched = client.patch(
        f"/admin/keys/{key_id}", json={"models": ["embed-model"], "name": "ci"}, headers=ADMIN
    )
    assert patched.status_code == 200 and patched.json()["name"] == "ci", patched.text
    r = client.post("/v1/chat/completions", json=CHAT, headers=bearer(newest))
    assert r.status_code == 403, r.text
    bad = client.patch(f"/admin/keys/{key_id}", json={"nope": 1}, headers=ADMIN)
    assert bad.status_code == 400, bad.text


def test_a_rotated_secret_is_unknown_without_a_grace_and_rotated_past_one(
    client: TestClient[Any],
) -> None:
    """As docs/tenants.md says: no grace (the default) keeps no trace of the old secret."""
    key_id, old = create(client)
    r = client.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN)
    gone = client.post("/v1/chat/completions", json=CHAT, headers=bearer(old))
    assert (gone.status_code, gone.json()["error"]["code"]) == (401, "invalid_api_key")
    new = r.json()["secret"]
    client.post(f"/admin/keys/{key_id}/rotate", json={"grace_s": 0.001}, headers=ADMIN)
    time.sleep(0.01)
    late = client.post("/v1/chat/completions", json=CHAT, headers=bearer(new))
    assert (late.status_code, late.json()["error"]["code"]) == (401, "api_key_rotated")


def test_a_key_scoped_to_a_model_no_backend_serves_is_refused(client: TestClient[Any]) -> None:
    r = client.post(
        "/admin/keys", json={"tenant": "acme", "models": ["chat-model", "tiny-chat"]}, headers=ADMIN
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "models"
    assert "`tiny-chat`" in error["message"] and "`chat-model`" not in error["message"]
    key_id, _ = create(client, models=["@cf/test/chat"])  # an alias is a served name
    r = client.patch(f"/admin/keys/{key_id}", json={"models": ["gone"]}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text


def test_config_tokens_cannot_be_revoked_through_the_api(client: TestClient[Any]) -> None:
    r = client.delete("/admin/keys/acme-prod", headers=ADMIN)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "config_token"
    assert "gateway config" in r.json()["error"]["message"]
    assert (
        client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer tok-acme"}
        ).status_code
        == 200
    )
    assert client.delete("/admin/keys/nokey", headers=ADMIN).status_code == 404


def test_a_key_over_its_own_limit_is_429(client: TestClient[Any]) -> None:
    _, secret = create(client, limits={"requests_per_minute": 2})
    codes = [
        client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    r = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    # the tenant's other tokens have windows of their own
    assert (
        client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer tok-acme"}
        ).status_code
        == 200
    )
    too_high = client.post(
        "/admin/keys",
        json={"tenant": "acme", "limits": {"requests_per_minute": 5000}},
        headers=ADMIN,
    )
    assert (
        too_high.status_code == 400
        and too_high.json()["error"]["param"] == "limits.requests_per_minute"
    )


def test_a_key_past_its_budget_is_429_until_the_period_ends(client: TestClient[Any]) -> None:
    _, secret = create(client, limits={"daily_tokens": 1})
    first = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 1, first.text
    r = client.post("/v1/chat/completions", json={**CHAT, "seed": 2}, headers=bearer(secret))
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "insufficient_quota"
    assert "T00:00:00Z" in r.json()["error"]["message"]  # renews at the next UTC midnight
    assert 1 <= int(r.headers["retry-after"]) <= 86400


def test_a_scoped_key_lists_and_retrieves_only_its_models(client: TestClient[Any]) -> None:
    _, secret = create(client, models=["@cf/test/embed"])  # scoped by an alias
    listed = client.get("/v1/models", headers=bearer(secret))
    assert listed.status_code == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == ["embed-model"]
    for name in ("embed-model", "@cf/test/embed"):
        r = client.get(f"/v1/models/{name}", headers=bearer(secret))
        assert r.status_code == 200 and r.json()["id"] == "embed-model", r.text
    hidden = client.get("/v1/models/chat-model", headers=bearer(secret))
    assert hidden.status_code == 404, hidden.text
    assert hidden.json()["error"]["code"] == "model_not_found"
    missing = client.get("/v1/models/no-such", headers=bearer(secret)).json()["error"]
    assert hidden.json()["error"] == {  # the same answer as for a model that does not exist
        **missing,
        "message": missing["message"].replace("no-such", "chat-model"),
    }
    everything = client.get("/v1/models", headers={"authorization": "Bearer tok-acme"}).json()
    assert {m["id"] for m in everything["data"]} == {"chat-model", "embed-model"}


def test_a_key_spends_its_own_budget_shown_beside_it(client: TestClient[Any]) -> None:
    spender, secret = create(client, limits={"daily_tokens": 3})
    other_id, other = create(client, limits={"daily_tokens": 3})
    assert client.get(f"/admin/keys/{spender}", headers=ADMIN).json()["spend"] == [
        {"period": "day", "tokens": 3, "tokens_spent": 0, "usd": None, "usd_spent": 0.0}
    ]
    first = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    (spend,) = client.get(f"/admin/keys/{spender}", headers=ADMIN).json()["spend"]
    assert spend["tokens_spent"] == used and used >= 3
    w = client.post(WAI + "@cf/test/chat", json={"prompt": "again"}, headers=bearer(secret))
    assert w.status_code == 429 and w.json()["success"] is False, w.text
    message = w.json()["errors"][0]["message"]
    assert "API key's daily budget of 3 tokens" in message and "T00:00:00Z" in message
    assert 1 <= int(w.headers["retry-after"]) <= 86400
    # the tenant's other key has a budget of its own, untouched
    assert client.post("/v1/chat/completions", json=CHAT, headers=bearer(other)).status_code == 200
    listed = {k["id"]: k for k in client.get("/admin/keys", headers=ADMIN).json()["data"]}
    assert listed[spender]["spend"][0]["tokens_spent"] == used
    assert listed[other_id]["spend"][0]["tokens_spent"] > 0
    page = client.get("/dashboard/api/keys", headers=ADMIN)
    assert page.status_code == 200, page.text
    rows = {k["id"]: k for k in page.json()["keys"]}
    assert rows[spender]["budgets"][0]["tokens_spent"] == used


def test_a_scoped_key_reads_no_cached_answer_of_another_model(client: TestClient[Any]) -> None:
    _, scoped = create(client, models=["embed-model"])
    answer = client.post(
        "/v1/chat/completions",
        json={**CHAT, "temperature": 0},  # deterministic: cached
        headers={"authorization": "Bearer tok-acme"},
    )
    where = answer.headers["content-location"]
    assert client.get(where, headers={"authorization": "Bearer tok-acme"}).status_code == 200
    refused = client.get(where, headers=bearer(scoped))  # the same tenant, another model
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "cache_miss"
    embedded = client.post(
        "/v1/embeddings", json={"model": "embed-model", "input": "x"}, headers=bearer(scoped)
    )
    again = client.get(embedded.headers["content-location"], headers=bearer(scoped))
    assert again.status_code == 200 and again.content == embedded.content
