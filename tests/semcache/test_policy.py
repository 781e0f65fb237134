"""Policy files: layered rules, validation errors that name file and field, safe reload."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from semcache.policy import (
    ADMIN_MOVED,
    DEFAULT_POLICY,
    ROUTES,
    AdminTable,
    PolicyError,
    PolicyHolder,
    load_policy,
    parse_policy,
)
from server.config import DEFAULT_CONFIG

LAYERED = """
[defaults]
ttl_s = 100
swr_s = 10
[defaults.prices]
input_per_m = 0.1
[defaults.semantic]
threshold = 0.95

[routes.chat]
swr_s = 20

[models."qwen3-0.6b"]
ttl_s = 300
prices = { output_per_m = 0.384, input_per_m = 0.045 }
[models."qwen3-0.6b".semantic]
enabled = true

[models."qwen3-0.6b".routes.chat]
shared = true
deterministic_only = false
"""


def write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_embedded_default_is_valid_and_documented() -> None:
    policy = load_policy()
    assert policy.source == str(DEFAULT_POLICY)
    for route in ROUTES:
        rule = policy.rule("any-model", route)
        # every route, embeddings and classification included, is each tenant's own
        assert rule.cacheable and rule.shared is False and rule.reveal == ()
        assert policy.scope(rule, "t1", "key:a") == "tenant:t1"
    assert not policy.warnings and not policy.share_groups
    assert policy.tiers.redis.url is None and policy.tiers.disk.enabled
    readme = (DEFAULT_POLICY.parent / "README.md").read_text()
    for field in (
        "ttl_s",
        "max_ttl_s",
        "swr_s",
        "shared",
        "deterministic_only",
        "prices",
        "max_tokens",
        "semantic",
        "tiers.redis",
        "admin",
    ):
        assert field in readme


def test_layers_override_field_by_field(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, LAYERED))
    chat = policy.rule("qwen3-0.6b", "chat")
    # model-route layer
    assert chat.shared and not chat.deterministic_only
    # model layer
    assert chat.ttl_s == 300
    assert chat.prices.input_per_m == 0.045 and chat.prices.output_per_m == 0.384
    # nested tables merge: model sets enabled, defaults set threshold
    assert chat.semantic.enabled and chat.semantic.threshold == 0.95
    # route layer
    assert chat.swr_s == 20
    emb = policy.rule("qwen3-0.6b", "embeddings")
    assert emb.swr_s == 10 and not emb.shared and emb.ttl_s == 300
    other = policy.rule("other-model", "chat")
    assert other.ttl_s == 100 and other.swr_s == 20 and other.prices.input_per_m == 0.1
    assert policy.rule("other-model", "no-such-route") == policy.defaults
    assert policy.model_ids == {"qwen3-0.6b"}


@pytest.mark.parametrize(
    ("text", "field", "expected"),
    [
        ("[defaults]\nttl_s = -5", "defaults.ttl_s", ">= 0"),
        ("[defaults]\nttl_s = 'long'", "defaults.ttl_s", "Expected `int`"),
        ("[routes.chatt]\nttl_s = 1", "routes.chatt", "expected one of chat"),
        ('[models."a/b".routes.chat]\nswr_s = 1.5', 'models."a/b".routes.chat.swr_s', "`int`"),
        ('[models."a/b".semantic]\nthreshold = 1.2', 'models."a/b".semantic.threshold', "<= 1.0"),
        ("[models.m]\nttl_s = 999999", "models.m.ttl_s", "expected ttl_s <= max_ttl_s"),
        ("[models.m.routes.chat.prices]\ninput = 1", "models.m.routes.chat.prices", "`input`"),
        ("[tiers.memory]\nmax_bytes = -1", "tiers.memory.max_bytes", ">= 0"),
        ("[tiers.redis]\ntimeout_s = 0", "tiers.redis.timeout_s", "> 0"),
        ("[admin]\ntokn = 'x'", "admin", "`tokn`"),
        ("cache = true", "(top level)", "`cache`"),
        ("[defaults.semantic]\nthreshold = 0.5", "defaults.semantic.min_threshold", "threshold"),
        ('[models.m.semantic]\nmode = "verified"', "models.m.semantic.mode", "chat route only"),
        ('[routes.chat.semantic]\nmode = "exact"', "routes.chat.semantic.mode", "enum value"),
        (
            '[routes.chat.semantic]\nmode = "verified"\nmax_error = 0.6',
            "routes.chat.semantic.max_error",
            "< 0.5",
        ),
        ("[routes.chat.semantic]\nmax_error = 0", "routes.chat.semantic.max_error", "> 0"),
        ('[routes.embeddings]\nshared = "acme"', "routes.embeddings.shared", "no share group"),
        ("[share_groups.acme]\ntenants = []", "share_groups.acme", "an empty group"),
        ('[defaults]\nreveal = ["hits"]', "defaults.reveal[0]", "enum value"),
        ('[routes.chat]\nreveal = ["age"]', "routes.chat.reveal", '"status" in the list'),
        ("[share_groups.a]\ntenant = ['x']", "share_groups.a", "`tenant`"),
        ('[routes.chat.semantic]\njudge = "llm"', "routes.chat.semantic.judge", "enum value"),
        (
            '[routes.chat.semantic]\nmode = "verified"\njudge = "model"',
            "routes.chat.semantic.judge_model",
            "expected its id",
        ),
        (
            "[routes.chat.semantic]\nexplores_per_minute = 0",
            "routes.chat.semantic.explores_per_minute",
            ">= 1",
        ),
    ],
)
def test_errors_name_file_field_and_expectation(
    tmp_path: Path, text: str, field: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {field}: "), message
    assert expected in message


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.toml")
    bad = write(tmp_path, "[defaults\nttl_s = 1")
    with pytest.raises(PolicyError, match=f"{bad}: invalid TOML"):
        load_policy(bad)


def test_parse_policy_names_its_source() -> None:
    with pytest.raises(PolicyError, match=r"^inline: defaults\.swr_s"):
        parse_policy(tomllib.loads("[defaults]\nswr_s = -1"), "inline")


def test_reload_keeps_the_old_policy_when_the_new_one_is_invalid(tmp_path: Path) -> None:
    path = write(tmp_path, "[defaults]\nttl_s = 100")
    holder = PolicyHolder(path)
    before = holder.current
    assert before.defaults.ttl_s == 100

    path.write_text("[defaults]\nttl_s = 'soon'")
    error = holder.reload()
    assert isinstance(error, PolicyError) and "defaults.ttl_s" in str(error)
    assert holder.current is before

    path.unlink()
    assert isinstance(holder.reload(), PolicyError)
    assert holder.current is before

    path.write_text("[defaults]\nttl_s = 200")
    assert holder.reload() is None
    assert holder.current.defaults.ttl_s == 200


def test_an_admin_table_is_read_and_warns_that_the_token_moved() -> None:
    """The admin token belongs in the gateway config (``server.identity.admin_token``); a
    policy's ``[admin]`` table is kept, fields left out unset, and named in the warnings."""
    policy = parse_policy(tomllib.loads("[admin]\ntoken = 'inline'"))
    assert policy.admin == AdminTable(token="inline")
    assert policy.warnings == (ADMIN_MOVED,)
    assert "[auth.admin]" in ADMIN_MOVED
    assert parse_policy({}).admin is None and not parse_policy({}).warnings


def test_the_shipped_policy_prices_every_model_of_the_embedded_default() -> None:
    """A hit on any model `make serve` runs saves money (the dashboard's USD saved is not
    $0); embeddings and classification are priced on their input only, as Workers AI does."""
    config = tomllib.loads(DEFAULT_CONFIG.read_text())
    policy = load_policy()
    for model in config["models"]:
        route = {"chat": "chat", "embeddings": "embeddings"}.get(model["task"], "classification")
        prices = policy.rule(model["id"], route).prices
        assert prices.input_per_m > 0, model["id"]
        assert (prices.output_per_m > 0) == (model["task"] == "chat"), model["id"]


def test_prices_compute_cost() -> None:
    rule = load_policy(Path(DEFAULT_POLICY)).defaults
    assert rule.prices.cost_usd(1_000_000, 1_000_000) == 0.0
    priced = parse_policy(
        tomllib.loads("[defaults.prices]\ninput_per_m = 0.045\noutput_per_m = 0.384")
    ).defaults
    assert priced.prices.cost_usd(2_000_000, 500_000) == pytest.approx(0.09 + 0.192)


def test_verified_mode_turns_chat_semantic_caching_on(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[models."m".routes.chat.semantic]\nmode = "verified"\nmax_error = 0.02\n'
        'judge = "embedding"\n',
    )
    policy = load_policy(path)
    sem = policy.rule("m", "chat").semantic
    assert sem.enabled and sem.verified and sem.max_error == 0.02 and sem.judge == "embedding"
    assert not policy.rule("m", "embeddings").semantic.verified
    assert not policy.rule("other", "chat").semantic.enabled
    off = write(tmp_path, '[models."m".routes.chat.semantic]\nmode = "verified"\nenabled = false\n')
    assert not load_policy(off).rule("m", "chat").semantic.verified


SHARING = """
[share_groups.acme]
tenants = ["acme-eu", "acme-us"]
keys = ["key:k1", "partner-token"]

[routes.embeddings]
shared = "acme"
reveal = ["status", "age"]

[routes.classification]
shared = true

[models."public-embedder".routes.embeddings]
shared = true
reveal = ["status"]
"""


def test_scopes_of_tenants_groups_and_keys(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, SHARING))
    emb = policy.rule("m", "embeddings")
    assert emb.shared == "acme" and emb.reveal == ("status", "age")
    # members share the group's scope: by tenant, or by the API key or token that sent it
    assert policy.scope(emb, "acme-eu", "key:zz") == "group:acme"
    assert policy.scope(emb, "acme-us", None) == "group:acme"
    assert policy.scope(emb, "other", "key:k1") == "group:acme"
    assert policy.scope(emb, "other", "partner-token") == "group:acme"
    # everyone else keeps a scope of their own
    assert policy.scope(emb, "other", "key:k2") == "tenant:other"
    assert policy.scope(emb, None, None) == "tenant:"
    assert policy.scope(policy.rule("m", "classification"), "x", None) == "shared"
    assert policy.scope(policy.rule("m", "chat"), "acme-eu", "key:k1") == "tenant:acme-eu"


def test_rules_sharing_with_every_tenant_are_warned_about(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, SHARING))
    assert len(policy.warnings) == 2
    cls, public = policy.warnings
    assert cls.startswith("routes.classification: shared = true shares answers across every")
    assert public.startswith("models.public-embedder.routes.embeddings: shared = true")
    for warning in policy.warnings:
        assert "how fast it is answered" in warning and "Sharing between tenants" in warning
    assert "reveal = ['status']" in public and "reveal" not in cls
