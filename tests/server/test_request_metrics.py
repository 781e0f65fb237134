"""``semcache_requests``: every answered request by route and status, monitoring left out."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from harness.metrics import parse_metric


def test_requests_are_counted_by_route_and_status(client: TestClient[Any]) -> None:
    body = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={"model": "nope"}).status_code in (400, 404)
    assert client.post("/v1/chat/completions", content=b"{").status_code == 400
    client.get("/health")
    page = client.get("/metrics").text
    route = {"route": "/v1/chat/completions"}
    assert parse_metric(page, "semcache_requests_total", {**route, "status": "200"}) == 3
    errors = sum(
        parse_metric(page, "semcache_requests_total", {**route, "status": code})
        for code in ("400", "404")
    )
    assert errors == 2
    assert "/health" not in page and "/metrics" not in page
