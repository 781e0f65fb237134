"""``/v1/responses`` over HTTP with an in-process backend: which requests the exact cache
answers (stateless ones), which pass through (stateful ones), a stream cut short stored
nowhere, stored responses fetched by id, and bad input in OpenAI's error shape.

(The same against a real vLLM, with the openai SDK, is in ``test_responses_sdk.py``.)
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from litestar.testing import TestClient

from backends.interfaces import BackendError
from harness.fake_vllm import FakeGeneration

Client = TestClient[Any]
PATH = "/v1/responses"
AUTH = {"authorization": "Bearer key-a"}
STATELESS = {"model": "chat-model", "input": "hi", "temperature": 0, "store": False}


def create(client: Client, body: dict[str, Any], **headers: str) -> Any:
    return client.post(PATH, json=body, headers={**AUTH, **headers})


def last_event(stream: bytes) -> bytes:
    return stream.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_stateless_deterministic_request_is_cached(client: Client, fake: FakeGeneration) -> None:
    miss = create(client, STATELESS)
    assert miss.status_code == 200 and miss.headers["cf-aig-cache-status"] == "MISS"
    assert miss.json()["object"] == "response"
    hit = create(client, STATELESS)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert hit.content == miss.content
    assert hit.headers["x-semcache-saved-tokens"] == "4"  # input and output tokens
    assert [path for path, _ in fake.calls] == [PATH]
    assert fake.calls[0][1]["model"] == "fake-model"  # only the model is rewritten
    assert fake.calls[0][1]["store"] is False


@pytest.mark.parametrize(
    "stateful",
    [
        pytest.param({"store": None}, id="store left to its default (true)"),
        pytest.param({"store": True}, id="store true"),
        pytest.param({"previous_response_id": "resp_fake1"}, id="previous_response_id"),
        pytest.param({"conversation": "conv_1"}, id="conversation"),
    ],
)
def test_a_stateful_request_passes_through_uncached(
    client: Client, fake: FakeGeneration, stateful: dict[str, Any]
) -> None:
    create(client, {"model": "chat-model", "input": "earlier"})  # stored: resp_fake1
    fake.calls.clear()
    body = {k: v for k, v in {**STATELESS, **stateful}.items() if v is not None}
    first, second = create(client, body), create(client, body)
    assert first.status_code == second.status_code == 200
    assert "cf-aig-cache-status" not in first.headers
    assert "cf-aig-cache-status" not in second.headers
    assert first.json()["id"] != second.json()["id"]  # each its own response
    assert len(fake.calls) == 2


def test_a_sampled_request_is_not_cached(client: Client, fake: FakeGeneration) -> None:
    body = {**STATELESS, "temperature": 0.8}
    assert create(client, body).headers["cf-aig-cache-status"] == "BYPASS"
    assert create(client, body).headers["cf-aig-cache-status"] == "BYPASS"
    assert len(fake.calls) == 2


def test_a_stream_is_relayed_then_replayed_byte_for_byte(
    client: Client, fake: FakeGeneration
) -> None:
    body = {**STATELESS, "stream": True}
    miss = create(client, body)
    assert miss.headers["cf-aig-cache-status"] == "MISS"
    assert miss.headers["content-type"].startswith("text/event-stream")
    assert miss.content.startswith(b"event: response.created\ndata: ")
    assert last_event(miss.content).startswith(b"event: response.completed\ndata: ")
    assert b"[DONE]" not in miss.content and b"error" not in miss.content
    hit = create(client, body)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert hit.content == miss.content
    assert len(fake.calls) == 1
    # a JSON request is cached under its own key
    assert create(client, STATELESS).headers["cf-aig-cache-status"] == "MISS"


def test_a_stateful_stream_is_relayed_whole_and_not_cached(
    client: Client, fake: FakeGeneration
) -> None:
    body = {"model": "chat-model", "input": "hi", "temperature": 0, "stream": True}
    first, second = create(client, body), create(client, body)
    assert b"event: response.completed" in first.content
    assert b"error" not in first.content  # no [DONE], yet a complete stream
    assert "cf-aig-cache-status" not in second.headers
    assert len(fake.calls) == 2


@pytest.mark.parametrize("cut", ["broken", "ended early"])
def test_a_partial_stream_is_never_cached(client: Client, fake: FakeGeneration, cut: str) -> None:
    body = {**STATELESS, "stream": True}
    if cut == "broken":
        fake.fail_stream_after = 2
    else:
        fake.cut_stream_at = 3
    partial = create(client, body)
    assert b"response.output_text.delta" in partial.content
    assert b"backend_stream_broken" in partial.content
    assert b"response.completed" not in partial.content
    fake.fail_stream_after = fake.cut_stream_at = None
    again = create(client, body)
    assert again.headers["cf-aig-cache-status"] == "MISS"
    assert b"event: response.completed" in again.content
    assert create(client, body).headers["cf-aig-cache-status"] == "HIT"


def test_a_failed_backend_call_is_not_cached(client: Client, fake: FakeGeneration) -> None:
    fake.fail = BackendError("unreachable", "down")
    assert create(client, STATELESS).status_code == 502
    fake.fail = None
    assert create(client, STATELESS).headers["cf-aig-cache-status"] == "MISS"


def test_a_stored_response_is_fetched_by_id(client: Client, fake: FakeGeneration) -> None:
    made = create(client, {"model": "chat-model", "input": "hi"}).json()
    got = client.get(f"{PATH}/{made['id']}", headers=AUTH)
    # the answer's usage also said what max_output_tokens the policy applied; the stored
    # response is the backend's
    applied = made["usage"].pop("max_tokens_applied"), made["usage"].pop("max_tokens_source")
    assert applied == (256, "default")
    assert got.status_code == 200 and got.json() == made


@pytest.mark.parametrize("stream", [False, True])
def test_another_tenants_response_is_404(
    client: Client, fake: FakeGeneration, stream: bool
) -> None:
    made = create(client, {"model": "chat-model", "input": "hi", "stream": stream})
    assert made.status_code == 200
    rid = fake.stored.popitem()[0]
    fake.stored[rid] = orjson.dumps({"id": rid, "object": "response"})
    other = {"authorization": "Bearer key-b"}
    assert client.get(f"{PATH}/{rid}", headers=AUTH).status_code == 200
    theirs = client.get(f"{PATH}/{rid}", headers=other)
    assert theirs.status_code == 404 and error_of(theirs)["param"] == "response_id"
    nobody = f"resp_{'0' * (len(rid) - 5)}"  # an id that never existed: the same answer
    never = client.get(f"{PATH}/{nobody}", headers=other)
    assert theirs.text.replace(rid, "<id>") == never.text.replace(nobody, "<id>")
    follow = {"model": "chat-model", "input": "and?", "previous_response_id": rid}
    refused = client.post(PATH, json=follow, headers=other)
    assert refused.status_code == 404 and error_of(refused)["param"] == "previous_response_id"
    assert create(client, follow).status_code == 200


def test_an_unknown_response_id_is_404(client: Client, fake: FakeGeneration) -> None:
    made = create(client, STATELESS).json()  # store: false keeps nothing
    for rid in (made["id"], "resp_nope", "a%3Fb"):
        r = client.get(f"{PATH}/{rid}", headers=AUTH)
        assert r.status_code == 404
        err = error_of(r)
        assert err["type"] == "invalid_request_error" and err["param"] == "response_id"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": "hi"}, 400, "model", None),
        ({"model": "chat-model"}, 400, "input", None),
        ({"model": "chat-model", "input": 3}, 400, "input", None),
        ({"model": "chat-model", "input": "hi", "temperature": 3}, 400, "temperature", None),
        ({"model": "chat-model", "input": "hi", "store": "yes"}, 400, "store", None),
        ({"model": "nope", "input": "hi"}, 404, None, "model_not_found"),
        ({"model": "embed-model", "input": "hi"}, 400, "model", "model_task_mismatch"),
    ],
)
def test_bad_input_is_an_openai_error(
    client: Client,
    fake: FakeGeneration,
    body: dict[str, Any],
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    r = create(client, body)
    assert r.status_code == status
    err = error_of(r)
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert not fake.calls


def test_tokens_of_responses_are_counted(client: Client, fake: FakeGeneration) -> None:
    create(client, {"model": "chat-model", "input": "hi"})
    create(client, {"model": "chat-model", "input": "hi", "stream": True})
    metrics = client.get("/metrics").text
    line = 'semcache_tokens_total{kind="completion",model="chat-model"}'
    assert orjson.loads(metrics.split(line, 1)[1].split("\n", 1)[0]) == 2


def test_null_fields_are_left_to_their_defaults(client: Client, fake: FakeGeneration) -> None:
    nulls = {"background": None, "truncation": None, "top_p": None}
    first = create(client, {**STATELESS, **nulls})
    again = create(client, STATELESS)  # the same request: null is the default
    assert first.status_code == again.status_code == 200
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert [path for path, _ in fake.calls] == [PATH]
    assert not set(nulls) & set(fake.calls[0][1])  # vLLM cuts its stream on a null background
