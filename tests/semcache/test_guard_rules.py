"""The policy's DLP and guardrail tables: layered like every rule, patched per tenant and
key, groups expanded, a version that changes with the rules; bad tables refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from semcache.policy import PolicyError, load_policy, parse_policy

POLICY: dict[str, Any] = {
    "defaults": {"dlp": {"prompt": {"FINANCIAL": "redact", "EMAIL_ADDRESS": "flag"}}},
    "routes": {"chat": {"dlp": {"answer": {"CREDIT_CARD": "redact"}}}},
    "models": {
        "m": {
            "dlp": {"prompt": {"IBAN_CODE": "block"}},
            "routes": {"chat": {"dlp": {"prompt": {"EMAIL_ADDRESS": "off"}}}},
        }
    },
    "guard": {
        "detectors": {"EMPLOYEE_ID": {"patterns": [r"\bEMP-\d{6}\b"]}},
        "tenants": {"acme": {"dlp": {"prompt": {"EMPLOYEE_ID": "block"}}}},
        "keys": {"key:abc": {"dlp": {"prompt": {"CREDIT_CARD": "block"}}}},
    },
}


def test_layers_merge_entity_by_entity() -> None:
    p = parse_policy(POLICY)
    base = p.guard_rule(p.rule("other", "embeddings"), None, None)
    assert base.prompt == {"CREDIT_CARD": "redact", "EMAIL_ADDRESS": "flag", "IBAN_CODE": "redact"}
    assert base.answer == {}
    chat = p.guard_rule(p.rule("other", "chat"), None, None)
    assert chat.answer == {"CREDIT_CARD": "redact"}
    model_chat = p.guard_rule(p.rule("m", "chat"), None, None)
    assert model_chat.prompt == {"CREDIT_CARD": "redact", "IBAN_CODE": "block"}


def test_tenant_and_key_patches_come_last() -> None:
    p = parse_policy(POLICY)
    rule = p.rule("other", "completions")
    assert p.guard_rule(rule, "acme", None).prompt["EMPLOYEE_ID"] == "block"
    assert "EMPLOYEE_ID" not in p.guard_rule(rule, "other", None).prompt
    assert p.guard_rule(rule, "acme", "key:abc").prompt["CREDIT_CARD"] == "block"


def test_the_version_changes_with_what_applies() -> None:
    p = parse_policy(POLICY)
    rule = p.rule("other", "completions")
    a, b = p.guard_rule(rule, None, None), p.guard_rule(rule, "acme", None)
    assert a.version != b.version
    assert a.version == parse_policy(POLICY).guard_rule(rule, None, None).version
    assert p.guard_rule(rule, "nobody", None).version == a.version


def test_a_policy_without_rules_inspects_nothing() -> None:
    p = load_policy()
    assert not p.guarded
    assert not p.guard_rule(p.rule("x", "chat"), "t", "k").active


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"defaults": {"dlp": {"prompt": {"CREDIT_CRAD": "redact"}}}},
            "defaults.dlp.prompt.CREDIT_CRAD: unknown entity type",
        ),
        (
            {"guard": {"detectors": {"BAD": {"patterns": ["(unclosed"]}}}},
            "guard.detectors.BAD.patterns[0]: invalid regex",
        ),
        (
            {"guard": {"detectors": {"EMPTY": {}}}},
            "guard.detectors.EMPTY: expected `patterns` or `deny_list`",
        ),
        (
            {"routes": {"chat": {"guardrails": {"prompt": {"x": {"threshold": 0.5}}}}}},
            "routes.chat.guardrails.model: missing",
        ),
        (
            {"defaults": {"guardrails": {"model": "g", "answer": {"x": {"threshold": 2}}}}},
            "defaults.guardrails.answer.x.threshold: 2.0 is not a score",
        ),
        (
            {"guard": {"tenants": {"t": {"dlp": {"answer": {"NOPE": "flag"}}}}}},
            "guard.tenants.t.dlp.answer.NOPE: unknown entity type",
        ),
        (
            {"defaults": {"dlp": {"prompt": {"CREDIT_CARD": "shred"}}}},
            "Invalid enum value 'shred'",
        ),
    ],
)
def test_bad_tables_are_refused_with_their_path(table: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(table, "p.toml")
    assert message in str(err.value) and str(err.value).startswith("p.toml: ")


def test_the_cli_check_refuses_an_unknown_entity(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[defaults.dlp.prompt]\nCREDIT_CRAD = "block"\n')
    with pytest.raises(PolicyError, match="CREDIT_CRAD: unknown entity type"):
        load_policy(path)
