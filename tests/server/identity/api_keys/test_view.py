"""The in-memory view: lookups by the secret's hash, expiry, revocation, rotation's grace,
and what another process writes to the same local store."""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path

import pytest

from server.identity.api_keys.admin import KeyAdmin
from server.identity.api_keys.hashing import KeyHasher
from server.identity.api_keys.records import KeyCreate, KeyRotate, KeyUpdate
from server.identity.api_keys.store import LocalKeyStore
from server.identity.api_keys.view import KeyView
from server.limits.settings import LimitSettings
from tests.server.identity.api_keys.conftest import ADMIN
from tests.support.stepped_clock import SteppedClock


async def test_a_new_key_is_found_by_its_secret_only(view: KeyView, admin: KeyAdmin) -> None:
    made = await admin.create(KeyCreate(tenant="acme", name="ci"), ADMIN)
    found = view.lookup(made.secret)
    assert found is not None and found.refused is None
    assert found.key.id == made.key.id and found.key.tenant == "acme"
    assert view.lookup(made.secret + "x") is None
    assert view.lookup(made.secret[:-1]) is None


async def test_the_store_holds_the_hash_never_the_secret(
    view: KeyView, admin: KeyAdmin, tmp_path: Path
) -> None:
    made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
    await admin.rotate(made.key.id, KeyRotate(grace_s=60), ADMIN)
    await view.flush_used()
    for path in (tmp_path / "keys").iterdir():
        assert made.secret not in path.read_text(), path.name
        assert made.secret.split("-", 3)[3] not in path.read_text(), path.name


async def test_an_expired_key_is_refused_from_its_expiry_on(
    view: KeyView, admin: KeyAdmin, clock: SteppedClock
) -> None:
    made = await admin.create(KeyCreate(tenant="acme", expires_in_s=10), ADMIN)
    clock.now += 9.99
    assert view.lookup(made.secret).refused is None  # type: ignore[union-attr]
    clock.now += 0.01
    assert view.lookup(made.secret).refused == "expired"  # type: ignore[union-attr]
    assert (await admin.show(made.key.id)).status == "expired"


async def test_a_revoked_key_is_refused(view: KeyView, admin: KeyAdmin) -> None:
    made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
    revoked = await admin.revoke(made.key.id, ADMIN)
    assert revoked.status == "revoked" and revoked.revoked_at is not None
    assert view.lookup(made.secret).refused == "revoked"  # type: ignore[union-attr]


async def test_rotation_keeps_the_old_secret_for_the_grace_period(
    view: KeyView, admin: KeyAdmin, clock: SteppedClock
) -> None:
    made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
    rotated = await admin.rotate(made.key.id, KeyRotate(grace_s=30), ADMIN)
    assert rotated.secret != made.secret
    assert rotated.key.previous_secret_valid_until == clock.now + 30
    assert view.lookup(rotated.secret).refused is None  # type: ignore[union-attr]
    assert view.lookup(made.secret).refused is None  # type: ignore[union-attr]
    clock.now += 30
    assert view.lookup(made.secret).refused == "rotated"  # type: ignore[union-attr]
    assert view.lookup(rotated.secret).refused is None  # type: ignore[union-attr]
    again = await admin.rotate(made.key.id, KeyRotate(), ADMIN)  # no grace: at once
    assert view.lookup(rotated.secret) is None
    assert view.lookup(again.secret).refused is None  # type: ignore[union-attr]


async def test_an_update_changes_the_scope_and_keeps_the_secret(
    view: KeyView, admin: KeyAdmin
) -> None:
    made = await admin.create(KeyCreate(tenant="acme", models=["a"]), ADMIN)
    info = await admin.update(made.key.id, KeyUpdate(models=None, metadata={"team": "x"}), ADMIN)
    assert info.models is None and info.metadata == {"team": "x"}
    found = view.lookup(made.secret)
    assert found is not None and found.key.models is None and found.key.version == 2


async def test_another_process_writing_the_store_is_seen(
    view: KeyView, tmp_path: Path, clock: SteppedClock
) -> None:
    other_view = KeyView(LocalKeyStore(tmp_path / "keys"), KeyHasher(b"s" * 32), clock=clock)
    other = KeyAdmin(other_view, defaults=LimitSettings(), config_tokens=[])
    made = await other.create(KeyCreate(tenant="acme"), ADMIN)
    assert view.lookup(made.secret) is None
    seen: list[str | None] = []
    reloaded = asyncio.Event()

    async def changed(key_id: str | None) -> None:
        await view.reload()  # reads the file in a thread: loop turns alone do not bound it
        seen.append(key_id)
        reloaded.set()

    store = view.store
    assert isinstance(store, LocalKeyStore)
    store.poll_s = 0.0
    watching = asyncio.create_task(store.watch(changed))
    try:
        await asyncio.wait_for(reloaded.wait(), timeout=30)  # a bound, not a margin
    finally:
        watching.cancel()
    assert seen == [None]
    assert view.lookup(made.secret) is not None


async def test_last_use_is_recorded_and_written_back(
    view: KeyView, admin: KeyAdmin, clock: SteppedClock
) -> None:
    made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
    assert (await admin.show(made.key.id)).last_used_at is None
    clock.now += 5
    view.lookup(made.secret)
    await view.flush_used()
    assert (await view.store.last_used())[made.key.id] == clock.now
    listed = await admin.list_keys("acme")
    assert [k.last_used_at for k in listed] == [clock.now]


async def test_a_lookup_compares_digests_in_constant_time(
    view: KeyView, admin: KeyAdmin, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert view.lookup(made.secret) is not None
    digest = view.hasher.digest(made.secret).encode()
    assert calls == [(digest, digest)]
