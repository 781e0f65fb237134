"""The admin token: the gateway config's ``[auth.admin]``, a policy's ``[admin]`` table still
read (with a warning), the config's winning when both are set."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from litestar.testing import TestClient

from backends.registry import ModelRegistry
from semcache.policy import ADMIN_MOVED, AdminTable, PolicyHolder
from server.app import create_app
from server.config import ConfigError, GatewayConfig, load_config
from server.identity.admin_token import AdminSettings, admin_token, from_policy
from server.identity.auth import AuthSettings

PURGE = "/admin/cache/purge"


@pytest.fixture(autouse=True)
def no_admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEMCACHE_ADMIN_TOKEN", raising=False)


def write_policy(path: Path, token: str, env: str = "SEMCACHE_TEST_ADMIN") -> Path:
    path.write_text(f'version = 1\n[admin]\ntoken = "{token}"\ntoken_env = "{env}"\n')
    return path


def purge_status(config: GatewayConfig, token: str) -> int:
    with TestClient(create_app(config, registry=ModelRegistry())) as client:
        answer = client.post(
            PURGE, json={"kind": "all"}, headers={"authorization": f"Bearer {token}"}
        )
        return answer.status_code


def test_the_settings_prefer_the_environment() -> None:
    settings = AdminSettings(token="inline", token_env="X_TOKEN")
    assert settings.resolve_token({}) == "inline"
    assert settings.resolve_token({"X_TOKEN": "from-env"}) == "from-env"
    assert AdminSettings(token_env=None).resolve_token({}) is None
    assert AdminSettings().resolve_token({"SEMCACHE_ADMIN_TOKEN": "dflt"}) == "dflt"


def test_a_policy_table_keeps_the_defaults_of_the_fields_it_leaves_out() -> None:
    assert from_policy(None) == AdminSettings()
    assert from_policy(AdminTable(token="t")) == AdminSettings(token="t")
    assert from_policy(AdminTable(token_env=None)) == AdminSettings(token_env=None)


def test_the_gateway_config_reads_an_auth_admin_table(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[auth.admin]\ntoken = "from-config"\ntoken_env = "X_ADMIN"\n')
    assert load_config(path).auth.admin == AdminSettings(token="from-config", token_env="X_ADMIN")
    path.write_text('[auth.admin]\ntokn = "x"\n')
    with pytest.raises(ConfigError, match="tokn"):
        load_config(path)


def test_the_admin_token_of_the_gateway_config_is_an_admin(tmp_path: Path) -> None:
    auth = AuthSettings(admin=AdminSettings(token="config-admin"))
    config = GatewayConfig(data_dir=str(tmp_path), auth=auth)
    assert purge_status(config, "config-admin") == 200
    assert purge_status(config, "someone") == 403  # an open gateway's tenant, no admin


def test_a_policy_admin_table_still_works_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = write_policy(tmp_path / "policy.toml", "policy-admin")
    config = GatewayConfig(data_dir=str(tmp_path), policy=str(policy))
    with caplog.at_level(logging.WARNING):
        assert purge_status(config, "policy-admin") == 200
    assert any(ADMIN_MOVED in record.getMessage() for record in caplog.records)


def test_the_gateway_config_wins_over_the_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = write_policy(tmp_path / "policy.toml", "policy-admin")
    auth = AuthSettings(admin=AdminSettings(token="config-admin"))
    config = GatewayConfig(data_dir=str(tmp_path), policy=str(policy), auth=auth)
    with caplog.at_level(logging.WARNING):
        assert purge_status(config, "config-admin") == 200
    assert purge_status(config, "policy-admin") == 403
    assert any("[admin] is ignored" in record.getMessage() for record in caplog.records)


def test_the_config_token_is_resolved_once_whatever_the_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = PolicyHolder(write_policy(tmp_path / "policy.toml", "policy-admin"))
    token = admin_token(
        AdminSettings(token="config-admin", token_env="SEMCACHE_TEST_ADMIN"), holder
    )
    assert token() == "config-admin"
    monkeypatch.setenv("SEMCACHE_TEST_ADMIN", "from-env")
    assert holder.reload() is None
    assert token() == "config-admin"  # the gateway config is read at start only


def test_a_policy_token_is_resolved_again_after_a_policy_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_policy(tmp_path / "policy.toml", "first")
    holder = PolicyHolder(path)
    token = admin_token(None, holder)
    assert token() == "first"
    monkeypatch.setenv("SEMCACHE_TEST_ADMIN", "from-env")
    assert token() == "first"  # the environment is read with the policy, not per request
    write_policy(path, "second")
    assert holder.reload() is None
    assert token() == "from-env"  # the environment variable comes first
    monkeypatch.delenv("SEMCACHE_TEST_ADMIN")
    assert holder.reload() is None
    assert token() == "second"


def test_without_either_the_token_is_the_default_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder = PolicyHolder()
    assert admin_token(None, holder)() is None
    monkeypatch.setenv("SEMCACHE_ADMIN_TOKEN", "dflt")
    assert admin_token(None, PolicyHolder())() == "dflt"
