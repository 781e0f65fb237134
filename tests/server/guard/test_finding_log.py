"""Each finding is one line on the ``semcache.guard`` logger: the type, the action, the
direction and the request id, never the value."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from prometheus_client import CollectorRegistry

from foundation.request import RequestContext
from semcache.policy import parse_policy
from server.guard.guardrails import Scorer
from server.guard.inspector import Guard
from server.guard.metrics import GuardMetrics
from tests.support.dlp_values import GENERATORS, SENTENCES, card


def test_a_flagged_value_is_logged_by_type_never_by_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = parse_policy(
        {"defaults": {"dlp": {"prompt": {"CREDIT_CARD": "flag", "EMAIL_ADDRESS": "redact"}}}}
    )
    guard = Guard(GuardMetrics(CollectorRegistry()), Scorer.__new__(Scorer))
    ctx = RequestContext(request_id="req-50")
    rule = guard.rule(policy, "m", "chat", ctx)
    value, mail = card(random.Random(50)), GENERATORS["EMAIL_ADDRESS"](random.Random(50))
    text = SENTENCES["CREDIT_CARD"].format(value) + " " + SENTENCES["EMAIL_ADDRESS"].format(mail)
    body = {"messages": [{"role": "user", "content": text}]}
    with caplog.at_level(logging.WARNING, logger="semcache.guard"):
        sent, headers = asyncio.run(guard.prompt(policy, rule, "chat", body, ctx))
    assert value in sent["messages"][0]["content"]  # flagged: sent on
    assert headers == {"x-semcache-dlp-prompt": "CREDIT_CARD=flag, EMAIL_ADDRESS=redact"}
    lines = [r.getMessage() for r in caplog.records if r.name == "semcache.guard"]
    assert len(lines) == 2
    flagged = next(line for line in lines if "CREDIT_CARD" in line)
    for word in ("CREDIT_CARD", "flag", "prompt", "req-50"):
        assert word in flagged
    assert any("EMAIL_ADDRESS" in line and "redact" in line for line in lines)
    for line in lines:
        assert value not in line and value.replace(" ", "") not in line and mail not in line
