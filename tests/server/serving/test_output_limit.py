"""The policy's max_tokens applied to a request's body, and said in its answer's usage."""

from __future__ import annotations

import orjson
import pytest

from semcache.max_tokens import MaxTokens
from server.serving.output_limit import limit_output, noted_item, noted_json

RULE = MaxTokens(default=256, cap=1024)
NOTE = {"max_tokens_applied": 256, "max_tokens_source": "default"}


@pytest.mark.parametrize(
    ("route", "body", "sent", "note"),
    [
        ("chat", {}, {"max_tokens": 256}, NOTE),
        ("chat", {"max_tokens": 20}, {"max_tokens": 20}, None),
        ("chat", {"max_completion_tokens": 5000}, {"max_completion_tokens": 1024}, "cap"),
        (
            "chat",  # both named: vLLM reads max_completion_tokens first, both are capped
            {"max_completion_tokens": 4000, "max_tokens": 2000},
            {"max_completion_tokens": 1024, "max_tokens": 1024},
            "cap",
        ),
        ("completions", {"max_tokens": None}, {"max_tokens": 256}, NOTE),
        ("responses", {}, {"max_output_tokens": 256}, NOTE),
        ("embeddings", {}, {}, None),  # no answer length to bound
    ],
)
def test_limit_output(
    route: str, body: dict[str, object], sent: dict[str, object], note: object
) -> None:
    limited, got = limit_output(route, {"model": "m", **body}, RULE)
    assert limited == {"model": "m", **body, **sent}
    if note == "cap":
        assert got == {"max_tokens_applied": 1024, "max_tokens_source": "cap"}
    else:
        assert got == note


def test_a_surface_default_applies_only_where_the_rule_has_none() -> None:
    body = {"model": "m"}
    assert limit_output("chat", body, MaxTokens(), fallback=256)[1] == NOTE
    assert limit_output("chat", body, MaxTokens(default=64), fallback=256)[0]["max_tokens"] == 64
    assert limit_output("chat", {"max_tokens": 9}, MaxTokens(), fallback=256)[1] is None


def test_the_note_goes_into_a_json_answers_usage() -> None:
    body = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 256}})
    doc = orjson.loads(noted_json(body, NOTE))
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 256, **NOTE}
    assert noted_json(body, None) is body
    assert noted_json(b'{"error": {}}', NOTE) == b'{"error": {}}'


def test_the_note_goes_into_the_usage_that_ends_a_stream() -> None:
    usage_chunk = orjson.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": 2}})
    assert orjson.loads(noted_item(usage_chunk, NOTE))["usage"] == {"completion_tokens": 2, **NOTE}
    content = orjson.dumps({"id": "c", "choices": [{"delta": {"content": '"usage"'}}]})
    assert noted_item(content, NOTE) is content
    assert noted_item(b"[DONE]", NOTE) == b"[DONE]"
    done = {"response": {"id": "r", "usage": {"output_tokens": 2}}}
    block = b"event: response.completed\ndata: " + orjson.dumps(done)
    name, _, data = noted_item(block, NOTE).partition(b"\ndata: ")
    assert name == b"event: response.completed"
    assert orjson.loads(data)["response"]["usage"] == {"output_tokens": 2, **NOTE}
    delta = b'event: response.output_text.delta\ndata: {"delta": "\\"usage\\""}'
    assert noted_item(delta, NOTE) is delta
