"""A key view over a local store in a temporary folder, on a clock the test moves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.identity.api_keys.admin import Actor, KeyAdmin
from server.identity.api_keys.hashing import KeyHasher
from server.identity.api_keys.store import LocalKeyStore
from server.identity.api_keys.view import KeyView
from server.limits.settings import LimitSettings
from tests.semcache.conftest import redis_prefix
from tests.support.stepped_clock import SteppedClock

__all__ = ["redis_prefix"]  # a Redis key prefix of its own per test

ADMIN = Actor("ops-admin", "ops")


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock()


@pytest.fixture
async def view(tmp_path: Path, clock: SteppedClock) -> AsyncIterator[KeyView]:
    keys = KeyView(LocalKeyStore(tmp_path / "keys"), KeyHasher(b"s" * 32), clock=clock)
    await keys.reload()
    yield keys
    await keys.aclose()


@pytest.fixture
def admin(view: KeyView) -> KeyAdmin:
    return KeyAdmin(
        view, defaults=LimitSettings(requests_per_minute=600), config_tokens=["acme-prod"]
    )
