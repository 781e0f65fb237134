"""The Redis key store on a real redis-server: two views see each other's changes through
pub/sub, and a view that missed messages catches up on its resync."""

from __future__ import annotations

import asyncio

import pytest

from server.identity.api_keys.admin import KeyAdmin
from server.identity.api_keys.hashing import KeyHasher
from server.identity.api_keys.records import KeyCreate, KeyRotate
from server.identity.api_keys.redis_store import RedisKeyStore
from server.identity.api_keys.view import KeyView
from server.limits.settings import LimitSettings
from tests.semcache.conftest import RedisServer
from tests.server.identity.api_keys.conftest import ADMIN
from tests.support.stepped_clock import SteppedClock
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow

SECRET = b"shared-server-secret-of-the-test"


def view_on(url: str, prefix: str) -> KeyView:
    return KeyView(RedisKeyStore(url, prefix), KeyHasher(SECRET))


async def test_a_change_on_one_view_reaches_the_other_through_pubsub(
    shared_redis_url: str, redis_prefix: str
) -> None:
    one, two = view_on(shared_redis_url, redis_prefix), view_on(shared_redis_url, redis_prefix)
    await one.start()
    await two.start()
    try:
        # The second looks for changes once subscribed (a cluster first learns its slot map,
        # seconds on a loaded machine); from then on a change reaches it within a second.
        await asyncio.wait_for(two.following.wait(), 30)
        admin = KeyAdmin(one, defaults=LimitSettings(), config_tokens=[])
        made = await admin.create(KeyCreate(tenant="acme"), ADMIN)
        await wait_until_async(lambda: two.lookup(made.secret) is not None, timeout_s=1.0)
        await admin.revoke(made.key.id, ADMIN)
        await wait_until_async(
            lambda: two.lookup(made.secret).refused == "revoked",  # type: ignore[union-attr]
            timeout_s=1.0,
        )
        rotated = await admin.rotate(made.key.id, KeyRotate(grace_s=60), ADMIN)
        await wait_until_async(lambda: two.lookup(rotated.secret) is not None, timeout_s=1.0)
        store = two.store
        assert isinstance(store, RedisKeyStore)
        dump = b"".join(await store.redis.hvals(store.records_key))  # type: ignore[misc]
        assert made.secret.encode() not in dump and rotated.secret.encode() not in dump
        assert [e.action for e in await store.read_audit(10)] == ["rotate", "revoke", "create"]
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_view_that_missed_a_change_catches_up_on_its_resync(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """A key whose change message was lost (written, then published where nobody listens, as
    by a gateway that died between the two) reaches a running view on its resync, which the
    test's clock drives. Checked against a resync that re-reads nothing: the key is never
    seen."""
    clock = SteppedClock()
    reader = KeyView(
        RedisKeyStore(redis_server.url, redis_prefix),
        KeyHasher(SECRET),
        clock=clock,
        sleep=clock.sleep,
        resync_s=30.0,
    )
    writer, lossy = view_on(redis_server.url, redis_prefix), view_on(redis_server.url, redis_prefix)
    lost_store = lossy.store
    assert isinstance(lost_store, RedisKeyStore)
    lost_store.channel += ":nobody-listens"
    await reader.start()
    try:
        await asyncio.wait_for(reader.following.wait(), 30)
        # the resync and the last-use flush wait on the test's clock
        await wait_until_async(lambda: clock.sleeping == 2, timeout_s=5.0)
        missed = await KeyAdmin(lossy, defaults=LimitSettings(), config_tokens=[]).create(
            KeyCreate(tenant="missed"), ADMIN
        )
        heard = await KeyAdmin(writer, defaults=LimitSettings(), config_tokens=[]).create(
            KeyCreate(tenant="heard"), ADMIN
        )
        # the message after the lost one arrived: the lost one never will
        await wait_until_async(lambda: reader.lookup(heard.secret) is not None, timeout_s=5.0)
        assert reader.lookup(missed.secret) is None
        clock.advance(reader.resync_s)
        await wait_until_async(lambda: reader.lookup(missed.secret) is not None, timeout_s=5.0)
        found = reader.lookup(missed.secret)
        assert found is not None and found.key.tenant == "missed" and found.refused is None
    finally:
        await reader.aclose()
        await writer.aclose()
        await lossy.aclose()
