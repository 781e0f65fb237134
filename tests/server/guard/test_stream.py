"""A streamed answer inspected chunk by chunk: a value split across chunks is redacted
before any of it leaves, a blocked one ends the stream, the window stays bounded."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from foundation.request import RequestContext
from foundation.sse import DONE
from semcache.guard_rules import GuardSettings
from semcache.policy import Policy, parse_policy
from server.errors import ApiError
from server.guard.detectors import Detectors
from server.guard.guardrails import Scorer
from server.guard.inspector import Guard
from server.guard.metrics import GuardMetrics
from server.guard.stream import StreamGuard
from tests.support.dlp_values import card, email


@pytest.fixture(scope="module")
def detectors() -> Detectors:
    return Detectors(GuardSettings())


def policy(answer: dict[str, str], hold_back: int = 32) -> Policy:
    return parse_policy(
        {"guard": {"hold_back_chars": hold_back}, "defaults": {"dlp": {"answer": answer}}}
    )


def chunk(piece: str, finish: str | None = None) -> bytes:
    return orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
    )


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run(sg: StreamGuard, items: list[bytes]) -> str:
    out = []
    for item in items:
        sent: Any = sg.feed(item)
        if sent != DONE:
            out.append(orjson.loads(sent)["choices"][0]["delta"]["content"])
    return "".join(out)


def guard_for(p: Policy, detectors: Detectors) -> tuple[Guard, StreamGuard, RequestContext]:
    guard = Guard(GuardMetrics(CollectorRegistry()), Scorer.__new__(Scorer))
    ctx = RequestContext(request_id="r")
    rule = p.guard_rule(p.rule("m", "chat"), None, None)
    return guard, StreamGuard(guard, p, rule, detectors, ctx), ctx


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_card_split_across_chunks_is_redacted(detectors: Detectors, size: int) -> None:
    value = card(random.Random(size))
    text = "Sure. " * 10 + f"Your card {value} is on file. " + "Thanks! " * 10
    p = policy({"CREDIT_CARD": "redact"})
    _, sg, ctx = guard_for(p, detectors)
    parts = pieces(text, size)
    items = [chunk(x) for x in parts[:-1]] + [chunk(parts[-1], "stop"), DONE]
    sent = run(sg, items)
    assert sent == text.replace(value, "<CREDIT_CARD>")
    assert ctx.usage.findings == ["answer:CREDIT_CARD:redact"]


def test_nothing_is_held_longer_than_twice_the_window(detectors: Detectors) -> None:
    p = policy({"EMAIL_ADDRESS": "redact"}, hold_back=16)
    _, sg, _ = guard_for(p, detectors)
    text = "plain words without anything to find " * 20
    fed, sent = "", ""
    for piece in pieces(text, 5):
        fed += piece
        sent += orjson.loads(sg.feed(chunk(piece)))["choices"][0]["delta"]["content"]
        assert len(fed) - len(sent) < 2 * 16  # held back: at most twice the window
    tail = orjson.loads(sg.feed(chunk("", "stop")))["choices"][0]["delta"]["content"]
    assert sent + tail == text


def test_a_blocked_value_ends_the_stream(detectors: Detectors) -> None:
    value = email(random.Random(1))
    p = policy({"EMAIL_ADDRESS": "block"})
    guard, sg, ctx = guard_for(p, detectors)
    items = [chunk(x) for x in pieces(f"Write to {value} today, " + "ok " * 30, 4)]
    with pytest.raises(ApiError) as err:
        run(sg, items)
    assert err.value.code == "response_blocked" and value not in err.value.message
    assert ctx.usage.findings == ["answer:EMAIL_ADDRESS:block"]
    text = guard.metrics.findings.metric.labels("EMAIL_ADDRESS", "block", "answer")._value.get()
    assert text == 1


def test_usage_and_done_pass_through(detectors: Detectors) -> None:
    p = policy({"CREDIT_CARD": "redact"})
    _, sg, _ = guard_for(p, detectors)
    usage = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 1}})
    assert sg.feed(usage) == usage
    assert sg.feed(DONE) == DONE
    asyncio.run(sg.finish())  # no guardrail: nothing to score
