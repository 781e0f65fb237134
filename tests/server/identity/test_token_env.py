"""A config token read from an environment variable (``token_env``): what a container's
Secret gives the gateway."""

from __future__ import annotations

import hashlib

import pytest

from server.config import ConfigError, parse_config
from server.identity.auth import TokenEntry


def config_with(entry: dict[str, object]) -> dict[str, object]:
    return {"auth": {"tokens": [entry]}}


def test_the_token_is_the_variable_s_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_TEST_TOKEN", "s3cret\n")  # a Secret file's trailing newline
    config = parse_config(config_with({"token_env": "SEMCACHE_TEST_TOKEN", "tenant": "ops"}))
    (entry,) = config.auth.tokens
    assert entry.digest() == hashlib.sha256(b"s3cret").hexdigest()
    assert entry.token is None  # never copied into the config


@pytest.mark.parametrize("value", [None, "", "  "])
def test_an_unset_or_empty_variable_makes_the_config_invalid(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("SEMCACHE_TEST_TOKEN", raising=False)
    else:
        monkeypatch.setenv("SEMCACHE_TEST_TOKEN", value)
    with pytest.raises(ConfigError, match="SEMCACHE_TEST_TOKEN is not set"):
        parse_config(config_with({"token_env": "SEMCACHE_TEST_TOKEN", "tenant": "ops"}))


def test_one_source_per_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_TEST_TOKEN", "x")
    with pytest.raises(ValueError, match="exactly one of"):
        TokenEntry(tenant="t", token="x", token_env="SEMCACHE_TEST_TOKEN")
    with pytest.raises(ValueError, match="exactly one of"):
        TokenEntry(tenant="t")
