"""A request past its model's context in each API's own words: OpenAI's ``code`` and
``param``, Anthropic's sentences (the ones Claude Code and LangChain read), Workers AI's."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from backends.vllm.context_refusal import ContextRefusal
from server.anthropic.errors import anthropic_error_body
from server.config import GatewayConfig
from server.errors import ApiError, error_response, openai_error_body
from server.serving.context_limit import limit_error
from server.surface import Surfaces
from server.surfaces import builtin_surfaces

CLAUDE_CODE = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)
"""What Claude Code reads to retry with a smaller ``max_tokens``."""


def openai(err: ApiError) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(openai_error_body(err))["error"]
    return error


@pytest.mark.parametrize(
    ("route", "param"), [("chat", "messages"), ("completions", "prompt"), ("responses", "input")]
)
def test_a_prompt_past_the_context_is_openais_context_length_exceeded(
    route: str, param: str
) -> None:
    err = limit_error(route, "max_tokens", "m", ContextRefusal("prompt", 2048, 3000))
    assert err.status == 400
    assert openai(err) == {
        "message": f"Input tokens exceed the configured limit of 2048 tokens. Your {param} "
        f"resulted in 3000 tokens. Please reduce the length of the {param}.",
        "type": "invalid_request_error",
        "param": param,
        "code": "context_length_exceeded",
    }
    body = orjson.loads(anthropic_error_body(err))
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 3000 tokens > 2048 maximum",
        },
    }


def test_an_uncounted_prompt_says_what_is_known() -> None:
    counted = ContextRefusal("prompt", 2048, 2049, exact=False)
    least = limit_error("chat", "max_tokens", "m", counted)
    assert "resulted in at least 2049 tokens" in least.message
    none = limit_error("chat", "max_tokens", "m", ContextRefusal("prompt", 2048, exact=False))
    assert "resulted in more than 2048 tokens" in none.message
    said = orjson.loads(anthropic_error_body(none))["error"]["message"]
    assert said == "prompt is too long: 2049 tokens > 2048 maximum"


def test_an_output_past_the_context_is_openais_too_large_and_anthropics_sum() -> None:
    err = limit_error(
        "chat", "max_completion_tokens", "m", ContextRefusal("output", 4096, 3000, 32000)
    )
    assert openai(err) == {
        "message": "max_completion_tokens is too large: 32000. This model supports at most "
        "4096 completion tokens, whereas you provided 32000.",
        "type": "invalid_request_error",
        "param": "max_completion_tokens",
        "code": "invalid_value",
    }
    said = orjson.loads(anthropic_error_body(err))["error"]
    assert said["type"] == "invalid_request_error"
    assert said["message"] == (
        "input length and `max_tokens` exceed context limit: 3000 + 32000 > 4096, decrease "
        "input length or `max_tokens` and try again"
    )
    match = CLAUDE_CODE.search(said["message"])
    assert match is not None and match.groups() == ("3000", "32000", "4096")


def test_an_output_past_the_context_of_an_uncounted_prompt_is_anthropics_ceiling() -> None:
    err = limit_error("chat", "max_tokens", "tiny", ContextRefusal("output", 4096, asked=64001))
    said = orjson.loads(anthropic_error_body(err))["error"]["message"]
    assert said == (
        "max_tokens: 64001 > 4096, which is the maximum allowed number of output tokens for tiny"
    )


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
        ("/client/v4/accounts/a/ai/run/@cf/x", "workers_ai"),
    ],
)
def test_each_route_answers_in_its_own_shape_uncached(path: str, kind: str) -> None:
    err = limit_error("chat", "max_tokens", "m", ContextRefusal("prompt", 2048, 3000))
    surfaces = Surfaces(builtin_surfaces(GatewayConfig()))
    resp = error_response(err, surfaces.errors_of(path))
    assert resp.status_code == 400
    assert resp.headers["cache-control"] == "no-store"
    doc = orjson.loads(resp.content)
    if kind == "openai":
        assert doc["error"]["code"] == "context_length_exceeded"
    elif kind == "anthropic":
        assert doc["error"]["message"].startswith("prompt is too long: 3000 tokens")
    else:
        assert doc["success"] is False and doc["result"] is None and doc["messages"] == []
        assert doc["errors"] == [
            {
                "code": 4000,
                "message": "The input (3000 tokens) exceeds this model's context window "
                "limit (2048 tokens); shorten the prompt.",
            }
        ]
