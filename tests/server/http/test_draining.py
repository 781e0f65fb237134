"""The drain middleware: while draining, new requests get 503 in their route's own format."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from server.http.draining import RETRY_AFTER_S, Drain

CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}


def test_while_draining_new_requests_get_503_and_health_still_answers(
    client: TestClient[Any],
) -> None:
    drain: Drain = client.app.state.drain
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert drain.in_flight == 0  # counted while it ran, and let go
    drain.draining = True  # what DrainingServer.begin sets on SIGTERM
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "shutting_down"
    cf = client.post("/client/v4/accounts/a/ai/run/@cf/test/chat", json={"prompt": "hi"})
    assert cf.status_code == 503
    assert cf.json()["success"] is False and cf.json()["errors"][0]["code"] == 5030
    assert client.get("/ready").json() == {"status": "draining"}
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert drain.refused == 3


async def test_wait_idle_returns_once_the_last_request_left() -> None:
    drain = Drain()
    drain.enter()
    drain.begin()
    assert not await drain.wait_idle(0.01)
    drain.leave()
    assert await drain.wait_idle(1.0)
