"""The detectors on generated values: each entity type found, checksums checked, custom
patterns and deny-lists, redaction by placeholder."""

from __future__ import annotations

import random

import pytest

from semcache.guard_rules import BUILTIN_ENTITIES, CustomDetector, GuardSettings
from server.guard.detectors import Detectors
from tests.support.dlp_values import GENERATORS, SENTENCES, entity_of, luhn_complete


@pytest.fixture(scope="module")
def detectors() -> Detectors:
    return Detectors(
        GuardSettings(
            detectors={
                "EMPLOYEE_ID": CustomDetector(patterns=(r"\bEMP-\d{6}\b",)),
                "CODENAME": CustomDetector(deny_list=("bluebird", "night jar")),
            }
        )
    )


def test_every_builtin_type_has_a_generated_case() -> None:
    assert {entity_of(case) for case in GENERATORS} == BUILTIN_ENTITIES


@pytest.mark.parametrize("case", sorted(GENERATORS))
def test_each_entity_type_is_found_and_redacted(detectors: Detectors, case: str) -> None:
    """Every built-in type looked for at once, as a rule naming them all does: each value
    is found whole, as its own type and nothing else."""
    rng = random.Random(case)
    entity = entity_of(case)
    for _ in range(5):
        value = GENERATORS[case](rng)
        text = SENTENCES[case].format(value)
        found = detectors.find(text, BUILTIN_ENTITIES)
        assert [(f.entity, text[f.start : f.end]) for f in found] == [(entity, value)]
        redacted = detectors.redact(text, found)
        assert value not in redacted and f"<{entity}>" in redacted


def test_a_card_number_with_a_wrong_check_digit_is_not_a_card(detectors: Detectors) -> None:
    good = luhn_complete("411111111111111")
    bad = good[:-1] + str((int(good[-1]) + 1) % 10)
    assert [f.entity for f in detectors.find(f"card {good}", ["CREDIT_CARD"])] == ["CREDIT_CARD"]
    assert detectors.find(f"card {bad}", ["CREDIT_CARD"]) == []


def test_an_iban_with_a_wrong_checksum_is_not_an_iban(detectors: Detectors) -> None:
    assert [f.entity for f in detectors.find("DE89370400440532013000", ["IBAN_CODE"])] == [
        "IBAN_CODE"
    ]
    assert detectors.find("DE88370400440532013000", ["IBAN_CODE"]) == []


def test_custom_patterns_and_deny_lists(detectors: Detectors) -> None:
    text = "Ask EMP-123456 about Bluebird and the Night Jar launch, not EMP-12."
    found = detectors.find(text, ["EMPLOYEE_ID", "CODENAME"])
    assert [(f.entity, text[f.start : f.end]) for f in found] == [
        ("EMPLOYEE_ID", "EMP-123456"),
        ("CODENAME", "Bluebird"),
        ("CODENAME", "Night Jar"),
    ]
    assert detectors.redact(text, found) == (
        "Ask <EMPLOYEE_ID> about <CODENAME> and the <CODENAME> launch, not EMP-12."
    )


def test_only_the_types_asked_for_are_looked_for(detectors: Detectors) -> None:
    text = "mail a.b@example.org or call +1 415-555-0100"
    assert [f.entity for f in detectors.find(text, ["EMAIL_ADDRESS"])] == ["EMAIL_ADDRESS"]
    assert detectors.find(text, []) == []


def test_a_jwt_must_decode_to_a_jose_header(detectors: Detectors) -> None:
    fake = "eyJub3RhIjoiaGVhZGVyIn0.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJlLWhlcmU"
    assert detectors.find(f"token {fake}", ["JWT"]) == []
