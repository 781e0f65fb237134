"""The admin operations: limits within the defaults, config tokens left alone, the audit."""

from __future__ import annotations

import msgspec
import pytest

from server.errors import ApiError
from server.identity.api_keys.admin import KeyAdmin
from server.identity.api_keys.records import KeyCreate, KeyRotate, KeyUpdate
from server.limits.settings import LimitSettings
from tests.server.identity.api_keys.conftest import ADMIN
from tests.support.stepped_clock import SteppedClock


async def test_a_key_limit_above_the_defaults_is_refused(admin: KeyAdmin) -> None:
    with pytest.raises(ApiError) as err:
        await admin.create(
            KeyCreate(tenant="acme", limits=LimitSettings(requests_per_minute=601)), ADMIN
        )
    assert err.value.status == 400 and err.value.param == "limits.requests_per_minute"
    made = await admin.create(
        KeyCreate(tenant="acme", limits=LimitSettings(requests_per_minute=5, daily_tokens=9)),
        ADMIN,
    )
    assert made.key.limits == LimitSettings(requests_per_minute=5, daily_tokens=9)


async def test_a_config_token_cannot_be_revoked_or_changed(admin: KeyAdmin) -> None:
    for call in (
        admin.revoke("acme-prod", ADMIN),
        admin.update("acme-prod", KeyUpdate(name="x"), ADMIN),
        admin.rotate("acme-prod", KeyRotate(), ADMIN),
    ):
        with pytest.raises(ApiError) as err:
            await call
        assert err.value.status == 409 and err.value.code == "config_token"
        assert "listed in the gateway config" in err.value.message
    with pytest.raises(ApiError) as missing:
        await admin.revoke("nope", ADMIN)
    assert missing.value.status == 404


async def test_every_change_is_audited_without_the_secret(
    admin: KeyAdmin, clock: SteppedClock
) -> None:
    made = await admin.create(KeyCreate(tenant="acme", name="ci", models=["m"]), ADMIN)
    clock.now += 1
    await admin.update(made.key.id, KeyUpdate(expires_at=clock.now + 60), ADMIN)
    rotated = await admin.rotate(made.key.id, KeyRotate(grace_s=5), ADMIN)
    await admin.revoke(made.key.id, ADMIN)
    entries = await admin.audit_log(10)
    assert [e.action for e in entries] == ["revoke", "rotate", "update", "create"]
    assert {(e.actor, e.actor_tenant, e.key_id, e.tenant) for e in entries} == {
        ("ops-admin", "ops", made.key.id, "acme")
    }
    assert entries[-1].changes == {"tenant": "acme", "name": "ci", "models": ["m"]}
    assert entries[-1].time == clock.now - 1
    text = msgspec.json.encode(entries).decode()
    for secret in (made.secret, rotated.secret):
        assert secret not in text and secret.split("-", 3)[3] not in text
    assert [e.action for e in await admin.audit_log(1)] == ["revoke"]
