"""Requests past the model's context through the app, on each API, with a fake backend that
refuses them as vLLM does: each answered in its route's words, a stream's before any event,
and never cached (a repeat reaches the backend again). An unknown model is each API's own."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from litestar.testing import TestClient

from backends.interfaces import UpstreamResponse
from foundation.request import RequestContext
from harness.fake_vllm import FakeGeneration, FakeStream

Client = TestClient[Any]

CONTEXT = 2048
TEMPLATE = 5
"""The tokens the fake's chat template adds to the words of the messages."""
LONG = [{"role": "user", "content": "w " * 3000}]
SHORT = [{"role": "user", "content": "hi there"}]
RUN = "/client/v4/accounts/acc/ai/run/@cf/test/chat"
BEARER = {"authorization": "Bearer a-tenant"}
CLAUDE_CODE = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


class RefusedStream(FakeStream):
    """vLLM's answer to a stream it refused: an error status and a JSON body."""

    def __init__(self, refused: UpstreamResponse) -> None:
        super().__init__([refused.body])
        self.status = refused.status
        self.content_type = "application/json"


class ContextFake(FakeGeneration):
    """A fake whose model has a 2048-token context: it refuses as vLLM 0.32 does and counts
    a prompt on ``/tokenize`` (a token per word, plus the template's)."""

    def __init__(self) -> None:
        super().__init__()
        self.known: int | None = CONTEXT
        self.tokenized = 0

    async def max_model_len(self) -> int | None:
        return self.known

    @staticmethod
    def tokens(body: dict[str, Any]) -> int:
        if "prompt" in body:
            return len(str(body["prompt"]).split())
        return TEMPLATE + sum(len(str(m["content"]).split()) for m in body["messages"])

    def refusal(self, body: dict[str, Any]) -> UpstreamResponse | None:
        for field in ("max_completion_tokens", "max_tokens"):
            asked = body.get(field)
            if isinstance(asked, int):
                break
        if isinstance(asked, int) and asked > CONTEXT:
            message = (
                f"{field}={asked} cannot be greater than max_model_len={CONTEXT}. "
                "Please request fewer output tokens."
            )
        elif self.tokens(body) > CONTEXT:
            message = (
                f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
                f"contains at least {CONTEXT + 1} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt."
            )
        else:
            return None
        error = {"message": message, "type": "BadRequestError", "param": field, "code": 400}
        return UpstreamResponse(status=400, body=orjson.dumps({"error": error}))

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        if path == "/tokenize":
            self.tokenized += 1
            doc = {"count": self.tokens(body), "max_model_len": CONTEXT, "tokens": []}
            return UpstreamResponse(status=200, body=orjson.dumps(doc))
        refused = self.refusal(body)
        if refused is not None:
            self.calls.append((path, body))
            return refused
        return await super().post(path, body, ctx)

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> FakeStream:
        refused = self.refusal(body)
        if refused is not None:
            self.calls.append((path, body))
            return RefusedStream(refused)
        return await super().open_stream(path, body, ctx)


@pytest.fixture
def fake() -> ContextFake:
    return ContextFake()


def generated(fake: ContextFake) -> int:
    """The generation requests the backend was sent."""
    return sum(1 for path, _ in fake.calls if path != "/tokenize")


def json_error(r: Any, status: int = 400) -> Any:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["cache-control"] == "no-store"
    return r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_over_the_window_is_context_length_exceeded(
    client: Client, fake: ContextFake, stream: bool
) -> None:
    body = {"model": "chat-model", "messages": LONG, "temperature": 0, "stream": stream}
    for n in (1, 2):  # a repeat reaches the backend again: nothing was cached
        err = json_error(client.post("/v1/chat/completions", json=body))["error"]
        assert err == {
            "message": f"Input tokens exceed the configured limit of {CONTEXT} tokens. Your "
            f"messages resulted in {3000 + TEMPLATE} tokens. Please reduce the length of "
            "the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
        assert generated(fake) == n and fake.tokenized == n


def test_openai_completions_over_the_window_name_the_prompt(
    client: Client, fake: ContextFake
) -> None:
    body = {"model": "chat-model", "prompt": "w " * 3000, "max_tokens": 8}
    err = json_error(client.post("/v1/completions", json=body))["error"]
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    assert "resulted in 3000 tokens" in err["message"]


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_max_tokens_past_the_context_is_too_large(
    client: Client, fake: ContextFake, known: bool, stream: bool
) -> None:
    """Refused before vLLM where the context is known, from vLLM's 400 where it is not."""
    fake.known = CONTEXT if known else None
    body = {"model": "chat-model", "messages": SHORT, "max_completion_tokens": 32000}
    r = client.post("/v1/chat/completions", json={**body, "stream": stream})
    err = json_error(r)["error"]
    assert err == {
        "message": "max_completion_tokens is too large: 32000. This model supports at most "
        f"{CONTEXT} completion tokens, whereas you provided 32000.",
        "type": "invalid_request_error",
        "param": "max_completion_tokens",
        "code": "invalid_value",
    }
    assert generated(fake) == (0 if known else 1)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_max_tokens_past_the_context_says_the_sum_claude_code_reads(
    client: Client, fake: ContextFake, stream: bool
) -> None:
    body = {"model": "chat-model", "max_tokens": 32000, "messages": SHORT, "stream": stream}
    err = json_error(client.post("/v1/messages", json=body))
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    match = CLAUDE_CODE.search(err["error"]["message"])
    assert match is not None, err
    prompt, asked, context = map(int, match.groups())
    assert (prompt, asked, context) == (2 + TEMPLATE, 32000, CONTEXT)
    retry = {**body, "max_tokens": context - prompt, "stream": False}
    assert client.post("/v1/messages", json=retry).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_prompt_over_the_window_is_too_long(
    client: Client, fake: ContextFake, stream: bool
) -> None:
    body = {"model": "chat-model", "max_tokens": 32000, "messages": LONG, "stream": stream}
    for small in (False, True):  # past the window alone, or with max_tokens past it too
        sent = {**body, "max_tokens": 16} if small else body
        err = json_error(client.post("/v1/messages", json=sent))["error"]
        assert err == {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {3000 + TEMPLATE} tokens > {CONTEXT} maximum",
        }


@pytest.mark.parametrize("stream", [False, True])
def test_workers_ai_prompt_over_the_window_is_its_envelope(
    client: Client, fake: ContextFake, stream: bool
) -> None:
    long = {"messages": LONG, "stream": stream}
    doc = json_error(client.post(RUN, json=long, headers=BEARER))
    assert doc == {
        "result": None,
        "success": False,
        "errors": [
            {
                "code": 4000,
                "message": f"The input ({3000 + TEMPLATE} tokens) exceeds this model's context "
                f"window limit ({CONTEXT} tokens); shorten the prompt.",
            }
        ],
        "messages": [],
    }
    # Workers AI's max_tokens is a ceiling: past the context, it is lowered, not refused
    r = client.post(RUN, json={"messages": SHORT, "max_tokens": 32000}, headers=BEARER)
    assert r.status_code == 200, r.text


def test_an_unknown_model_is_each_apis_own(client: Client) -> None:
    chat = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": SHORT})
    assert json_error(chat, 404)["error"] == {
        "message": "The model `gpt-9` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    messages = {"model": "gpt-9", "max_tokens": 8, "messages": SHORT}
    err = json_error(client.post("/v1/messages", json=messages), 404)
    assert err["type"] == "error" and err["error"]["type"] == "not_found_error"
    assert "gpt-9" in err["error"]["message"]
