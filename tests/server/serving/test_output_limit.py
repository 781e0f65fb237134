"""The policy's max_tokens applied to a request's body, and said in its answer's usage."""

from __future__ import annotations

import orjson
import pytest

from semcache.max_tokens import MaxTokens
from server.serving.output_limit import NO_LIMIT, OutputLimit, limit_output, noted_item, noted_json

RULE = MaxTokens(default=256, cap=1024)
NOTE = {"max_tokens_applied": 256, "max_tokens_source": "default"}
LIMIT = OutputLimit(NOTE, 256)


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
        assert got.note == {"max_tokens_applied": 1024, "max_tokens_source": "cap"}
    else:
        assert got.note == note


def test_a_surface_default_applies_only_where_the_rule_has_none() -> None:
    body = {"model": "m"}
    assert limit_output("chat", body, MaxTokens(), fallback=256)[1] == LIMIT
    assert limit_output("chat", body, MaxTokens(default=64), fallback=256)[0]["max_tokens"] == 64
    assert limit_output("chat", {"max_tokens": 9}, MaxTokens(), fallback=256)[1] == NO_LIMIT


def test_a_bound_past_the_context_is_lowered_to_it_and_only_a_ceiling_is_the_requests() -> None:
    rule = MaxTokens(default=4096)
    limited, limit = limit_output("chat", {}, rule, context=2048)
    assert limited == {"max_tokens": 2048} and limit.note == {**NOTE, "max_tokens_applied": 4096}
    # an OpenAI request's own value goes to vLLM as it is (refused there past the context)
    assert limit_output("chat", {"max_tokens": 5000}, MaxTokens(), context=2048)[0] == {
        "max_tokens": 5000
    }
    # Workers AI's own value is a ceiling: lowered, said only when the context lowers it
    limited, limit = limit_output(
        "chat", {"max_tokens": 5000}, MaxTokens(), context=2048, ceiling=True
    )
    assert limited == {"max_tokens": 2048} and limit == OutputLimit(None, 2048, 2048)
    assert limit_output("chat", {"max_tokens": 9}, MaxTokens(), context=2048, ceiling=True)[1] == (
        OutputLimit(None, 9, 2048)
    )


def test_the_note_says_what_the_context_left_when_the_prompt_left_less_than_the_bound() -> None:
    limit = OutputLimit(NOTE, 256, 2048)
    left = {"max_tokens_applied": 148, "max_tokens_source": "context"}
    assert limit.said({"prompt_tokens": 1900}) == left
    assert limit.said({"input_tokens": 1900}) == left  # the Responses API's usage
    assert limit.said({"prompt_tokens": 1000}) == NOTE
    assert OutputLimit(None, 1000, 2048).said({"prompt_tokens": 1900}) == left
    assert OutputLimit(None, 100, 2048).said({"prompt_tokens": 1900}) is None
    assert OutputLimit(NOTE, 256, None).said({"prompt_tokens": 1900}) == NOTE


def test_the_note_goes_into_a_json_answers_usage() -> None:
    body = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 256}})
    doc = orjson.loads(noted_json(body, LIMIT))
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 256, **NOTE}
    assert noted_json(body, NO_LIMIT) is body
    assert noted_json(b'{"error": {}}', LIMIT) == b'{"error": {}}'


def test_the_note_goes_into_the_usage_that_ends_a_stream() -> None:
    usage_chunk = orjson.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": 2}})
    assert orjson.loads(noted_item(usage_chunk, LIMIT))["usage"] == {"completion_tokens": 2, **NOTE}
    content = orjson.dumps({"id": "c", "choices": [{"delta": {"content": '"usage"'}}]})
    assert noted_item(content, LIMIT) is content
    assert noted_item(b"[DONE]", LIMIT) == b"[DONE]"
    done = {"response": {"id": "r", "usage": {"output_tokens": 2}}}
    block = b"event: response.completed\ndata: " + orjson.dumps(done)
    name, _, data = noted_item(block, LIMIT).partition(b"\ndata: ")
    assert name == b"event: response.completed"
    assert orjson.loads(data)["response"]["usage"] == {"output_tokens": 2, **NOTE}
    delta = b'event: response.output_text.delta\ndata: {"delta": "\\"usage\\""}'
    assert noted_item(delta, LIMIT) is delta
