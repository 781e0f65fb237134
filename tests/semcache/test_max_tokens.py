"""A rule's max_tokens: the default for requests that name none, the cap on those that do."""

from __future__ import annotations

import tomllib

import pytest

from semcache.max_tokens import Applied, MaxTokens
from semcache.policy import PolicyError, parse_policy


@pytest.mark.parametrize(
    ("rule", "asked", "applied"),
    [
        (MaxTokens(), None, None),  # nothing to apply: the backend's own default
        (MaxTokens(), 10_000, None),
        (MaxTokens(default=256), None, Applied(256, "default")),
        (MaxTokens(default=256), 4_000, None),  # no cap: the request's own value stands
        (MaxTokens(default=256, cap=1024), 512, None),  # inside the cap it wins
        (MaxTokens(default=256, cap=1024), 1024, None),
        (MaxTokens(default=256, cap=1024), 1025, Applied(1024, "cap")),
        (MaxTokens(cap=64), None, Applied(64, "cap")),  # no default: the cap bounds it
        (MaxTokens(default=512, cap=64), None, Applied(64, "default")),  # never above the cap
    ],
)
def test_applied(rule: MaxTokens, asked: int | None, applied: Applied | None) -> None:
    assert rule.applied(asked) == applied


def test_the_layers_merge_field_by_field() -> None:
    policy = parse_policy(
        tomllib.loads(
            """
[routes.chat.max_tokens]
default = 256
[models."m".max_tokens]
cap = 100
[models."m".routes.completions.max_tokens]
default = 32
"""
        )
    )
    assert policy.rule("m", "chat").max_tokens == MaxTokens(default=256, cap=100)
    assert policy.rule("m", "completions").max_tokens == MaxTokens(default=32, cap=100)
    assert policy.rule("other", "chat").max_tokens == MaxTokens(default=256)
    assert policy.rule("other", "completions").max_tokens == MaxTokens()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[defaults.max_tokens]\ndefault = -1", "defaults.max_tokens.default: Expected `int` >= 0"),
        ("[routes.chat.max_tokens]\nlimit = 5", "routes.chat.max_tokens: Object contains unknown"),
    ],
)
def test_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(tomllib.loads(text))
