"""``HEAD`` answers as ``GET`` does, status and headers (``Content-Length`` included), with
no body: on the app and through uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from harness.gateway import GatewayThread
from server.config import GatewayConfig

PATHS = (
    "/",
    "/health",
    "/ready",
    "/openapi.json",
    "/docs",
    "/v1/models",
    "/v1/models/chat-model",
    "/v1/models/no-such-model",
    "/client/v4/accounts/a/ai/models/search",
    "/v1/files/file-missing",
)
VARYING = frozenset({"date", "x-request-id", "server"})
"""Headers that differ between any two answers."""
AUTH = {"authorization": "Bearer t"}


def same_answer(get: httpx.Response, head: httpx.Response) -> None:
    assert head.status_code == get.status_code, head.request.url
    assert head.content == b""
    headers = {k: v for k, v in get.headers.items() if k not in VARYING}
    assert {k: v for k, v in head.headers.items() if k not in VARYING} == headers


def test_head_is_get_without_the_body(client: TestClient[Any]) -> None:
    for path in PATHS:
        get = client.get(path, headers=AUTH, follow_redirects=False)
        same_answer(get, client.head(path, headers=AUTH, follow_redirects=False))
    search = "/client/v4/accounts/a/ai/models/search"  # no token: GET's 401
    same_answer(client.get(search), client.head(search))
    assert client.head(search).status_code == 401
    assert client.head("/v1/chat/completions").status_code == 405  # no GET there either


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayThread]:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    gw = GatewayThread(GatewayConfig(data_dir=str(tmp_path)), reg).start()
    try:
        yield gw
    finally:
        gw.stop()


def test_head_through_uvicorn(gateway: GatewayThread) -> None:
    with httpx.Client(base_url=gateway.url, headers=AUTH) as http:
        for path in PATHS:
            get = http.get(path)
            head = http.head(path)
            same_answer(get, head)
            assert int(head.headers.get("content-length", "0")) == len(get.content)
        assert http.get("/health").status_code == 200  # the connection still serves
        # Claude Code probes the base URL at start: it answers, without a token too
        probe = httpx.head(f"{gateway.url}/")
        assert probe.status_code == 200 and probe.content == b""
        assert http.get("/").json()["openapi"] == "/openapi.json"
