"""A stored answer made to look newly made: new ids of the same form, the present time."""

from __future__ import annotations

import orjson

from semcache.entry import CachedAnswer
from semcache.restamp import restamped


def test_a_json_answer_gets_a_new_id_of_its_form_and_the_present_time() -> None:
    old = {"id": "chatcmpl-3f9a2c1b", "object": "chat.completion", "created": 5, "choices": []}
    got = orjson.loads(restamped(CachedAnswer(body=orjson.dumps(old)), 1_700_000_000.7).body or b"")
    assert got["id"] != old["id"] and got["id"].startswith("chatcmpl-")
    assert len(got["id"]) == len(old["id"])
    assert got["created"] == 1_700_000_000
    assert {k: v for k, v in got.items() if k not in ("id", "created")} == {
        "object": "chat.completion",
        "choices": [],
    }


def test_a_streams_chunks_keep_one_new_id_between_them() -> None:
    chunks = [
        orjson.dumps({"id": "cmpl-ab12", "created": 1, "choices": [{"text": t}]}) for t in "xyz"
    ]
    got = [orjson.loads(c) for c in restamped(CachedAnswer(chunks=chunks), 99.0).chunks or []]
    assert len({c["id"] for c in got}) == 1 and got[0]["id"] != "cmpl-ab12"
    assert [c["choices"][0]["text"] for c in got] == ["x", "y", "z"]
    assert {c["created"] for c in got} == {99}


def test_responses_events_are_stamped_inside_their_response_too() -> None:
    inner = {"id": "resp_0123abcd", "created_at": 3, "status": "completed"}
    block = b"event: response.completed\ndata: " + orjson.dumps({"response": inner})
    (got,) = restamped(CachedAnswer(chunks=[block]), 42.0).chunks or []
    name, data = got.split(b"\ndata: ")
    assert name == b"event: response.completed"
    response = orjson.loads(data)["response"]
    assert response["created_at"] == 42 and response["id"].startswith("resp_")
    assert response["id"] != inner["id"] and len(response["id"]) == len(inner["id"])


def test_what_is_not_an_openai_object_is_left_alone() -> None:
    item = CachedAnswer(body=b"\x00\x01raw vector", content_type="application/x-semcache-item")
    assert restamped(item, 1.0) is item
    listed = CachedAnswer(body=b"[0.1, 0.9]")
    assert restamped(listed, 1.0).body == b"[0.1, 0.9]"
