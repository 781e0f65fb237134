"""``tools: []`` is no tools on every surface: the backend gets none, and the request shares
its cache entry with one that named no tools."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from harness.fake_vllm import FakeGeneration
from server.errors import ApiError
from server.serving.tool_fields import without_empty_tools

ASK = [{"role": "user", "content": "no tools please"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": []},
        {"tools": None},
        {"tools": [], "tool_choice": "auto"},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": False},
        {"tool_choice": "none"},
    ],
)
def test_no_tools_leaves_only_the_rest(extra: dict[str, Any]) -> None:
    assert without_empty_tools({"model": "m", **extra}) == {"model": "m"}


def test_tools_and_plain_bodies_are_kept_as_they_are() -> None:
    body = {"model": "m", "tools": [TOOL], "tool_choice": "required"}
    assert without_empty_tools(body) is body
    plain = {"model": "m"}
    assert without_empty_tools(plain) is plain


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_choice_that_needs_a_tool_is_a_400(choice: Any) -> None:
    with pytest.raises(ApiError) as caught:
        without_empty_tools({"model": "m", "tools": [], "tool_choice": choice})
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def _sent(fake: FakeGeneration) -> dict[str, Any]:
    return fake.calls[-1][1]


def _status(r: Any) -> str:
    return str(r.headers.get("cf-aig-cache-status", ""))


def test_openai_chat(client: TestClient[Any], fake: FakeGeneration) -> None:
    body = {"model": "chat-model", "messages": ASK, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, "tools": [], "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert not {"tools", "tool_choice"} & set(_sent(fake))
    again = client.post("/v1/chat/completions", json=body)
    assert again.status_code == 200 and _status(again) == "HIT" and len(fake.calls) == 1
    refused = client.post(
        "/v1/chat/completions", json={**body, "tools": [], "tool_choice": "required"}
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tool_choice"
    assert refused.json()["error"]["type"] == "invalid_request_error"


def test_openai_responses(client: TestClient[Any], fake: FakeGeneration) -> None:
    body = {"model": "chat-model", "input": "no tools please", "store": False, "temperature": 0}
    r = client.post("/v1/responses", json={**body, "tools": [], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert fake.calls[-1][0] == "/v1/responses"
    assert not {"tools", "tool_choice"} & set(_sent(fake))
    again = client.post("/v1/responses", json=body)
    assert again.status_code == 200 and _status(again) == "HIT" and len(fake.calls) == 1


def test_anthropic_messages(client: TestClient[Any], fake: FakeGeneration) -> None:
    body = {"model": "chat-model", "max_tokens": 8, "messages": ASK, "temperature": 0}
    r = client.post("/v1/messages", json={**body, "tools": [], "tool_choice": {"type": "auto"}})
    assert r.status_code == 200, r.text
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(_sent(fake))
    again = client.post("/v1/messages", json=body)
    assert again.status_code == 200 and _status(again) == "HIT" and len(fake.calls) == 1
    anything = {**body, "tools": [], "tool_choice": {"type": "any"}}
    refused = client.post("/v1/messages", json=anything)
    assert refused.status_code == 400
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"


def test_workers_ai_run(client: TestClient[Any], fake: FakeGeneration) -> None:
    path = "/client/v4/accounts/acct/ai/run/@cf/test/chat"
    body = {"messages": ASK, "temperature": 0}
    client.headers["authorization"] = "Bearer t"
    r = client.post(path, json={**body, "tools": [], "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert not {"tools", "tool_choice"} & set(_sent(fake))
    again = client.post(path, json=body)
    assert again.status_code == 200 and _status(again) == "HIT" and len(fake.calls) == 1
