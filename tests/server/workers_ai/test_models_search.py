"""Workers AI's model search and model schemas, driven by Cloudflare's own SDK
(``client.ai.models.list`` and ``client.ai.models.schema.get``) against the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from server.workers_ai import catalog

cloudflare = pytest.importorskip("cloudflare")

ACCOUNT = "acct"
SEARCH = f"/client/v4/accounts/{ACCOUNT}/ai/models/search"
SCHEMA = f"/client/v4/accounts/{ACCOUNT}/ai/models/schema"


def registry() -> ModelRegistry:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "acme", "fake", "r", "t"))
    reg.add(ModelInfo("other-chat", "chat", (), "meta", "fake", "r", "t"))
    for n in range(3):
        name = f"embed-{n}"
        reg.add(ModelInfo(name, "embeddings", (f"@cf/test/{name}",), "acme", "fake", "r", "n"))
    reg.add(ModelInfo("sentiment", "classification", ("@cf/test/sst",), "acme", "fake", "r", "n"))
    return reg


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient[Any]]:
    tokens = [
        TokenEntry(token="tok-all", tenant="acme", roles=["admin"]),
        TokenEntry(token="tok-acct", tenant="acme", accounts=[ACCOUNT]),
    ]
    config = GatewayConfig(data_dir=str(tmp_path), auth=AuthSettings(tokens=tokens))
    with TestClient(create_app(config, registry=registry())) as client:
        yield client


def scoped_key(http: TestClient[Any], *models: str) -> str:
    r = http.post(
        "/admin/keys",
        json={"tenant": "acme", "models": list(models)},
        headers={"authorization": "Bearer tok-all"},
    )
    assert r.status_code == 200, r.text
    secret: str = r.json()["secret"]
    return secret


def sdk(http: TestClient[Any], token: str = "tok-all") -> Any:
    return cloudflare.Cloudflare(
        api_token=token,
        base_url=f"{http.base_url}/client/v4",
        http_client=http,
        max_retries=0,
    )


def test_the_sdk_lists_every_model_page_by_page(http: TestClient[Any]) -> None:
    cf = sdk(http)
    names = [m["name"] for m in cf.ai.models.list(account_id=ACCOUNT, per_page=2)]
    embeds = [f"@cf/test/embed-{n}" for n in range(3)]
    assert names == sorted(["@cf/test/chat", "other-chat", *embeds, "@cf/test/sst"])
    first = cf.ai.models.list(account_id=ACCOUNT, per_page=2)
    assert first.result_info is not None and first.result_info.page == 1
    assert [m["name"] for m in first.result] == names[:2]
    whole = http.get(SEARCH, headers={"authorization": "Bearer tok-all"}).json()
    assert whole["success"] is True and whole["errors"] == []
    assert whole["result_info"] == {"page": 1, "per_page": 20, "count": 6, "total_count": 6}
    chat = next(m for m in whole["result"] if m["name"] == "@cf/test/chat")
    assert chat["task"]["name"] == "Text Generation"
    assert set(chat["task"]) == {"id", "name", "description"}
    assert {"property_id": "model_id", "value": "chat-model"} in chat["properties"]
    assert set(chat) >= {"id", "source", "name", "description", "task", "created_at", "tags"}


def test_search_task_and_author_filter(http: TestClient[Any]) -> None:
    cf = sdk(http)

    def names(**query: Any) -> list[str]:
        return [m["name"] for m in cf.ai.models.list(account_id=ACCOUNT, **query)]

    assert names(search="EMBED-1") == ["@cf/test/embed-1"]
    assert names(search="chat-model") == ["@cf/test/chat"]  # the id finds its alias
    assert names(task="Text Classification") == ["@cf/test/sst"]
    assert names(task="text embeddings", per_page=1) == [f"@cf/test/embed-{n}" for n in range(3)]
    assert names(task="chat", author="meta") == ["other-chat"]
    assert names(search="nothing like it") == []


def test_a_scoped_key_sees_its_models_only(http: TestClient[Any]) -> None:
    cf = sdk(http, scoped_key(http, "@cf/test/chat"))
    assert [m["name"] for m in cf.ai.models.list(account_id=ACCOUNT)] == ["@cf/test/chat"]
    with pytest.raises(cloudflare.NotFoundError):
        cf.ai.models.schema.get(account_id=ACCOUNT, model="@cf/test/sst")


def test_schemas_of_each_task(http: TestClient[Any]) -> None:
    cf = sdk(http)
    chat = cf.ai.models.schema.get(account_id=ACCOUNT, model="@cf/test/chat")
    assert chat.input.type == "object" and chat.output.type == "object"
    raw = http.get(
        SCHEMA, params={"model": "chat-model"}, headers={"authorization": "Bearer tok-all"}
    ).json()["result"]
    assert {"prompt", "messages", "max_tokens"} <= set(raw["input"]["properties"])
    assert "response" in raw["output"]["properties"]
    sst = cf.ai.models.schema.get(account_id=ACCOUNT, model="@cf/test/sst")
    assert sst.output.type == "array"
    with pytest.raises(cloudflare.NotFoundError):
        cf.ai.models.schema.get(account_id=ACCOUNT, model="nope")


def test_errors_come_in_the_envelope(http: TestClient[Any]) -> None:
    for path, query in ((SEARCH, {}), (SCHEMA, {"model": "@cf/test/chat"})):
        refused = http.get(path, params=query)
        assert refused.status_code == 401 and refused.json()["success"] is False
    ok = {"authorization": "Bearer tok-all"}
    for query in (
        {"page": "0"},
        {"per_page": "x"},
        {"per_page": "100000"},
        {"format": "openrouter"},
    ):
        r = http.get(SEARCH, params=query, headers=ok)
        assert r.status_code == 400, (query, r.text)
        assert r.json()["success"] is False and r.json()["errors"][0]["code"] == 4000
    other = http.get(SEARCH.replace(ACCOUNT, "other"), headers={"authorization": "Bearer tok-acct"})
    assert other.status_code == 403 and other.json()["success"] is False
    assert http.get(SEARCH, headers={"authorization": "Bearer tok-acct"}).status_code == 200
    missing = http.get(SCHEMA, headers=ok)
    assert missing.status_code == 400 and missing.json()["success"] is False


def test_a_page_past_the_end_is_empty() -> None:
    models = list(registry().models.values())
    found, page = catalog.search(models, {"page": "9", "per_page": "5"})
    assert found == [] and page.total_count == 6 and page.count == 0
