"""GET /v1/cache/{digest}: a stored answer read again by the Content-Location its first
answer named; scoped by tenant, gone after a purge."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from harness.fake_vllm import FakeGeneration

Client = TestClient[Any]
ADMIN = "edge-admin"


def chat(text: str) -> dict[str, Any]:
    return {
        "model": "chat-model",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
    }


def test_an_embedding_is_read_again_by_its_digest_by_its_tenant_only(client: Client) -> None:
    first = client.post("/v1/embeddings", json={"model": "embed-model", "input": "by digest"})
    where = first.headers["content-location"]
    assert where.startswith("/v1/cache/") and len(where) == len("/v1/cache/") + 64
    again = client.get(where)
    assert again.status_code == 200
    assert again.content == first.content
    assert again.headers["etag"] == first.headers["etag"]
    assert again.headers["cache-control"].startswith("private, max-age=")
    assert again.headers["cf-aig-cache-status"] == "HIT"
    cond = client.get(where, headers={"if-none-match": first.headers["etag"]})
    assert cond.status_code == 304 and cond.content == b""
    assert cond.headers["content-location"] == where
    # another tenant: the same 404 as a key never stored
    theirs = client.get(where, headers={"authorization": "Bearer anyone"})
    never = client.get("/v1/cache/" + "0" * 64, headers={"authorization": "Bearer anyone"})
    assert theirs.status_code == never.status_code == 404
    assert theirs.json() == never.json()


def test_a_tenant_answer_is_only_its_tenants(client: Client, fake: FakeGeneration) -> None:
    alice = {"authorization": "Bearer alice"}
    first = client.post("/v1/chat/completions", json=chat("mine"), headers=alice)
    assert first.status_code == 200 and first.headers["vary"] == "Authorization"
    where = first.headers["content-location"]
    mine = client.get(where, headers=alice)
    assert mine.status_code == 200 and mine.json() == first.json()
    assert mine.headers["cache-control"].startswith("private, max-age=")
    for other in ({"authorization": "Bearer bob"}, {}):
        theirs = client.get(where, headers=other)
        assert theirs.status_code == 404
        assert theirs.json()["error"]["code"] == "cache_miss"
        assert theirs.headers["cache-control"] == "no-store"
    assert len(fake.calls) == 1


def test_a_purged_answer_is_gone_and_its_etag_misses(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SEMCACHE_ADMIN_TOKEN", ADMIN)
    body = {"model": "embed-model", "input": "purged by key"}
    first = client.post("/v1/embeddings", json=body)
    where, etag = first.headers["content-location"], first.headers["etag"]
    purged = client.post(
        "/admin/cache/purge",
        json={"kind": "key", "target": first.headers["x-semcache-key"]},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert purged.status_code == 200
    assert client.get(where).status_code == 404
    query = "/v1/embeddings?model=embed-model&input=purged+by+key"
    refilled = client.get(query, headers={"if-none-match": etag})
    assert refilled.status_code == 200 and refilled.headers["etag"] != etag
    # A model purge changes the key itself: the old digest names nothing any more.
    where = refilled.headers["content-location"]
    client.post(
        "/admin/cache/purge",
        json={"kind": "model", "target": "embed-model"},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert client.get(where).status_code == 404


@pytest.mark.parametrize("digest", ["0123456789ab", "z" * 64, "0" * 65])
def test_a_malformed_digest_is_400(client: Client, digest: str) -> None:
    r = client.get(f"/v1/cache/{digest}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "digest"


def test_an_unknown_digest_is_404(client: Client) -> None:
    assert client.get("/v1/cache/" + "0" * 64).status_code == 404
