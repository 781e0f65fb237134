"""Bad input gets OpenAI-shaped errors with the right status; never a trace, never a 500."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from litestar.testing import TestClient

from backends.interfaces import BackendError
from harness.fake_vllm import FakeGeneration

Client = TestClient[Any]

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"]
    return err


def test_malformed_json_is_400(client: Client) -> None:
    r = client.post(
        CHAT,
        content=b'{"model": "chat-model", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert error_of(r)["code"] == "invalid_json"


def test_non_object_body_is_400(client: Client) -> None:
    r = client.post(CHAT, content=b"[1, 2]")
    assert r.status_code == 400
    assert error_of(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"presence_penalty": 9}, "presence_penalty"),
    ],
)
def test_wrong_field_is_400_naming_it(
    client: Client, fake: FakeGeneration, extra: dict[str, Any], param: str
) -> None:
    r = client.post(CHAT, json={"model": "chat-model", "messages": MSG, **extra})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == param
    assert param in err["message"]
    assert fake.calls == []


def test_missing_model_field_is_400(client: Client) -> None:
    r = client.post(CHAT, json={"messages": MSG})
    assert r.status_code == 400
    assert "model" in error_of(r)["message"]


def test_unknown_model_is_404_model_not_found(client: Client) -> None:
    r = client.post(CHAT, json={"model": "gpt-9", "messages": MSG})
    assert r.status_code == 404
    err = error_of(r)
    assert err["code"] == "model_not_found"
    assert err["type"] == "invalid_request_error"  # OpenAI's, not Anthropic's not_found_error
    assert err["param"] is None


def test_wrong_task_is_400(client: Client) -> None:
    r = client.post(CHAT, json={"model": "embed-model", "messages": MSG})
    assert r.status_code == 400
    assert error_of(r)["code"] == "model_task_mismatch"


def test_body_too_large_is_413(client: Client, fake: FakeGeneration) -> None:
    big = "x" * (70 * 1024)
    r = client.post(
        CHAT, json={"model": "chat-model", "messages": [{"role": "user", "content": big}]}
    )
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"
    assert fake.calls == []


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (BackendError("unreachable", "down", retry_after_s=2), 502),
        (BackendError("timeout", "slow", retry_after_s=1), 504),
        (BackendError("unavailable", "none healthy", retry_after_s=5), 503),
        (BackendError("overloaded", "busy", retry_after_s=1), 429),
    ],
)
def test_backend_failures_map_to_5xx_with_retry_after(
    client: Client, fake: FakeGeneration, failure: BackendError, status: int
) -> None:
    fake.fail = failure
    for stream in (False, True):
        r = client.post(CHAT, json={"model": "chat-model", "messages": MSG, "stream": stream})
        assert r.status_code == status
        assert r.headers["retry-after"] == str(failure.retry_after_s)
        error_of(r)


def test_alias_resolves_and_model_is_rewritten_for_backend(
    client: Client, fake: FakeGeneration
) -> None:
    r = client.post(
        CHAT,
        json={
            "model": "@cf/test/chat",
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "seed": 7,
            "x_custom": {"a": 1},
        },
    )
    assert r.status_code == 200
    path, sent = fake.calls[0]
    assert path == "/v1/chat/completions"
    assert sent["model"] == "fake-model"
    # fields the gateway does not interpret pass through unchanged
    assert sent["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert sent["seed"] == 7 and sent["x_custom"] == {"a": 1}


def test_stream_broken_mid_answer_ends_with_error_event(
    client: Client, fake: FakeGeneration
) -> None:
    fake.fail_stream_after = 2
    r = client.post(CHAT, json={"model": "chat-model", "messages": MSG, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert b"[DONE]" not in r.content
    last = orjson.loads(events[-1])
    assert last["error"]["code"] == "backend_stream_broken"


def test_unknown_route_and_method(client: Client) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404
    error_of(r)
    r = client.get(CHAT)
    assert r.status_code == 405
    error_of(r)


def test_embeddings_bad_input(client: Client) -> None:
    for bad, param in [([], "input"), ([1, "a"], "input"), (["ok", ""], "input[1]"), (7, "input")]:
        r = client.post("/v1/embeddings", json={"model": "embed-model", "input": bad})
        assert r.status_code == 400, bad
        assert error_of(r)["param"] == param
    r = client.post("/v1/embeddings", json={"model": "embed-model", "input": "x", "dimensions": 12})
    assert r.status_code == 400
    assert error_of(r)["param"] == "dimensions"
    r = client.post(
        "/v1/embeddings", json={"model": "embed-model", "input": "x", "encoding_format": "png"}
    )
    assert r.status_code == 400
    assert error_of(r)["param"] == "encoding_format"


def test_a_huge_integral_float_in_an_extra_field_is_not_a_server_error(client: Client) -> None:
    body = {"model": "embed-model", "input": ["good"], "logit_bias": 1e308}
    r = client.post(
        "/v1/embeddings", content=b'{"model":"embed-model","input":["good"],"logit_bias":1e+308}'
    )
    assert r.status_code == 200, r.text
    again = client.post("/v1/embeddings", json=body)
    assert again.status_code == 200
    assert again.json()["data"] == r.json()["data"]
