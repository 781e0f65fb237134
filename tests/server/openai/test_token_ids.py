"""Token-id inputs: ``/v1/embeddings`` ``input`` and ``/v1/completions`` ``prompt`` take ids,
and a wrong one (negative, past the vocabulary, not an integer, an empty or too deep list)
is a 400 in OpenAI's shape naming the field, never a 500 nor the vector of some other text."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from harness.fake_vllm import FakeGeneration
from server.openai.token_ids import MAX_TOKEN_ID, InputError, out_of_vocabulary, token_id_lists

MINILM_VOCAB = 30522

BAD = [
    pytest.param([[-5]], "negative", id="negative"),
    pytest.param([-1, 2], "negative", id="flat-negative"),
    pytest.param([[MAX_TOKEN_ID + 1]], "past any vocabulary", id="huge"),
    pytest.param([2**63], "past any vocabulary", id="past-int64"),
    pytest.param([[]], "empty", id="empty-list"),
    pytest.param([[[1]]], "not a token id", id="too-deep"),
    pytest.param([[1, 2.5]], "not a token id", id="float"),
    pytest.param([[1, True]], "not a token id", id="boolean"),
    pytest.param([[1, "a"]], "not a token id", id="string-in-ids"),
    pytest.param([1, [2]], "Expected", id="ids-and-lists"),
    pytest.param([1.5], "Expected", id="float-alone"),
]


def test_lists_of_ids_are_read_and_checked() -> None:
    assert token_id_lists([1, 2], "input") == [[1, 2]]
    assert token_id_lists([[1], [0, MAX_TOKEN_ID]], "input") == [[1], [0, MAX_TOKEN_ID]]
    assert token_id_lists(["a"], "input") is None
    with pytest.raises(InputError) as caught:
        token_id_lists([[1], [2, -3]], "input")
    assert caught.value.param == "input[1]" and "input[1][1]" in str(caught.value)


def test_the_vocabulary_bounds_ids() -> None:
    assert out_of_vocabulary([[0, 9]], 10, "input") is None
    error = out_of_vocabulary([[0], [10]], 10, "input")
    assert error is not None and error.param == "input" and "0 to 9" in str(error)


def _refused(r: Any, field: str, words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(field)
    assert words in error["message"]


@pytest.mark.parametrize(("value", "words"), BAD)
def test_embeddings_refuse_a_wrong_id(client: TestClient[Any], value: Any, words: str) -> None:
    r = client.post("/v1/embeddings", json={"model": "embed-model", "input": value})
    _refused(r, "input", words)


def test_embeddings_ids_past_the_models_vocabulary(client: TestClient[Any]) -> None:
    r = client.post("/v1/embeddings", json={"model": "embed-model", "input": [[MINILM_VOCAB]]})
    _refused(r, "input", f"0 to {MINILM_VOCAB - 1}")
    last = client.post(
        "/v1/embeddings", json={"model": "embed-model", "input": [[101, MINILM_VOCAB - 1, 102]]}
    )
    assert last.status_code == 200, last.text
    assert len(last.json()["data"]) == 1


def test_embeddings_of_ids_are_those_of_their_text(client: TestClient[Any]) -> None:
    text = client.post("/v1/embeddings", json={"model": "embed-model", "input": "hello world"})
    ids = client.post("/v1/embeddings", json={"model": "embed-model", "input": [7592, 2088]})
    assert ids.status_code == 200, ids.text
    assert text.json()["data"][0]["embedding"] == ids.json()["data"][0]["embedding"]


@pytest.mark.parametrize(("value", "words"), BAD)
def test_completions_refuse_a_wrong_id(
    client: TestClient[Any], fake: FakeGeneration, value: Any, words: str
) -> None:
    r = client.post("/v1/completions", json={"model": "chat-model", "prompt": value})
    _refused(r, "prompt", words)
    assert fake.calls == []


def test_completions_pass_ids_on(client: TestClient[Any], fake: FakeGeneration) -> None:
    for prompt in ([1, 2, 3], [[1, 2], [3]], ["a", "b"], "a"):
        r = client.post("/v1/completions", json={"model": "chat-model", "prompt": prompt})
        assert r.status_code == 200, r.text
        assert fake.calls[-1][1]["prompt"] == prompt
