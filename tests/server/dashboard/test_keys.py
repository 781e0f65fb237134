"""The dashboard's keys page: the list with last use and spend against budgets, the create
form's answer (the secret, once) and revoke; the secret on no page."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from tests.server.identity.api_keys.test_http import ADMIN, CHAT, app, bearer, client

__all__ = ["app", "client"]  # the app with a fake backend, an admin and a tenant token

FORM = {**ADMIN, "x-semcache-dashboard": "1"}


def test_keys_are_made_listed_and_revoked_from_the_dashboard(client: TestClient[Any]) -> None:
    body = {"tenant": "acme", "name": "dash", "limits": {"daily_tokens": 1000}}
    refused = client.post("/dashboard/api/actions/keys/new", json=body, headers=ADMIN)
    assert refused.status_code == 403  # a form posted from elsewhere lacks the header
    r = client.post("/dashboard/api/actions/keys/new", json=body, headers=FORM)
    assert r.status_code == 200, r.text
    key_id, secret = r.json()["key"]["id"], r.json()["secret"]
    used = client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert used.status_code == 200, used.text
    page = client.get("/dashboard/keys", headers=ADMIN)
    assert page.status_code == 200 and f'data-key="{key_id}"' in page.text
    assert secret not in page.text and secret.split("-", 3)[3] not in page.text
    (row,) = client.get("/dashboard/api/keys", headers=ADMIN).json()["keys"]
    assert row["last_used_at"] is not None and row["status"] == "active"
    (day,) = row["budgets"]
    assert day["tokens"] == 1000 and day["tokens_spent"] == used.json()["usage"]["total_tokens"]
    r = client.post(f"/dashboard/api/actions/keys/{key_id}/revoke", headers=FORM)
    assert r.status_code == 200 and r.json()["status"] == "revoked", r.text
    assert client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)).status_code == 401
    (row,) = client.get("/dashboard/api/keys", headers=ADMIN).json()["keys"]
    assert row["status"] == "revoked"
    actions = [e["action"] for e in client.get("/admin/audit", headers=ADMIN).json()["data"]]
    assert actions == ["revoke", "create"]
