"""The judges of an explored request; the ``model`` judge against a fake chat backend."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.interfaces import BackendError, UpstreamResponse
from foundation.request import RequestContext
from semcache.semantic.verified.judges import EmbeddingJudge, ExactJudge, NoVerdict, judge_for
from semcache.semantic_settings import SemanticRule
from server.serving.model_judge import ModelJudge, parse_verdict


def reply(content: object, status: int = 200) -> UpstreamResponse:
    body = {
        "choices": [{"message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 60, "completion_tokens": 1},
    }
    return UpstreamResponse(status=status, body=orjson.dumps(body))


class FakeChat:
    """A chat backend that answers every request with ``answer`` and keeps the requests."""

    name = "judge"
    served_model = "judge-served"

    def __init__(self, answer: UpstreamResponse | Exception) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.contexts: list[RequestContext] = []

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        assert path == "/v1/chat/completions"
        self.bodies.append(body)
        self.contexts.append(ctx)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Any:
        raise AssertionError("the judge does not stream")

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


CTX = RequestContext(request_id="r-judge", tenant="acme", salt_scope="acme")


@pytest.mark.parametrize(
    ("content", "verdict"),
    [
        ("yes", True),
        ("Yes.", True),
        ("  NO \n", False),
        ("no.", False),
        ("Yes, they agree.", None),
        ("yes no", None),
        ("maybe", None),
        ("", None),
        (None, None),
    ],
)
def test_the_reply_is_parsed_strictly(content: object, verdict: bool | None) -> None:
    assert parse_verdict(reply(content).body) is verdict


def test_a_reply_that_is_not_a_chat_completion_is_no_verdict() -> None:
    assert parse_verdict(b"not json") is None
    assert parse_verdict(b'{"choices": []}') is None


async def test_the_model_judge_asks_the_backend_a_short_question() -> None:
    backend = FakeChat(reply("no"))
    usages: list[Any] = []
    judge = ModelJudge(backend, CTX, max_tokens=3, on_usage=usages.append)
    assert await judge.same("Paris.", "Lyon.", "What is the capital of France?") is False
    (body,) = backend.bodies
    assert body["model"] == "judge-served"
    assert body["max_tokens"] == 3 and body["temperature"] == 0
    assert body["structured_outputs"] == {"choice": ["yes", "no"]}  # vLLM decodes only these
    system, user = body["messages"]
    assert "yes or no" in system["content"]
    for text in ("What is the capital of France?", "Paris.", "Lyon."):
        assert text in user["content"]
    assert backend.contexts == [CTX]  # the explored request's tenant and prefix-cache scope
    assert usages == [{"prompt_tokens": 60, "completion_tokens": 1}]


async def test_the_model_judge_says_yes_and_skips_equal_answers() -> None:
    backend = FakeChat(reply("YES"))
    judge = ModelJudge(backend, CTX)
    assert await judge.same("Paris is the capital.", "It is Paris.", "q") is True
    assert await judge.same("Paris.", "  paris. ", "q") is True
    assert len(backend.bodies) == 1  # equal answers need no model


@pytest.mark.parametrize(
    "answer",
    [
        reply("I think so"),
        reply("yes", status=500),
        BackendError("unreachable", "connection refused"),
    ],
)
async def test_a_failed_or_unclear_judge_gives_no_verdict(
    answer: UpstreamResponse | Exception,
) -> None:
    judge = ModelJudge(FakeChat(answer), CTX)
    assert await judge.same("Paris.", "Lyon.", "q") is None


def test_the_rule_picks_the_judge() -> None:
    encoder: Any = object()
    rule = SemanticRule(enabled=True, mode="verified")
    assert isinstance(judge_for(rule, encoder), ExactJudge)
    embedding = SemanticRule(enabled=True, mode="verified", judge="embedding")
    assert isinstance(judge_for(embedding, encoder), EmbeddingJudge)
    by_model = SemanticRule(enabled=True, mode="verified", judge="model", judge_model="j")
    model = ModelJudge(FakeChat(reply("yes")), CTX)
    assert judge_for(by_model, encoder, model) is model
    assert isinstance(judge_for(by_model, encoder), NoVerdict)  # its model is not configured
