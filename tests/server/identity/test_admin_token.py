"""The policy's admin token as authentication sees it: resolved once per policy snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from semcache.policy import PolicyHolder
from server.identity.auth import policy_admin_token


def write(path: Path, token: str) -> None:
    path.write_text(f'version = 1\n[admin]\ntoken = "{token}"\ntoken_env = "SEMCACHE_TEST_ADMIN"\n')


def test_the_admin_token_is_resolved_again_after_a_policy_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "policy.toml"
    write(path, "first")
    holder = PolicyHolder(path)
    token = policy_admin_token(holder)
    assert token() == "first"
    monkeypatch.setenv("SEMCACHE_TEST_ADMIN", "from-env")
    assert token() == "first"  # the environment is read with the policy, not per request
    write(path, "second")
    assert holder.reload() is None
    assert token() == "from-env"  # the environment variable comes first
    monkeypatch.delenv("SEMCACHE_TEST_ADMIN")
    assert holder.reload() is None
    assert token() == "second"
