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


async def test_a_view_reads_the_whole_store_when_it_reloads(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    writer = view_on(redis_server.url, redis_prefix)
    reader = view_on(redis_server.url, redis_prefix)  # not started: it hears no message
    try:
        admin = KeyAdmin(writer, defaults=LimitSettings(), config_tokens=[])
        made = [await admin.create(KeyCreate(tenant=f"t{i}"), ADMIN) for i in range(3)]
        assert len(reader) == 0
        await reader.reload()
        assert len(reader) == 3
        assert {reader.lookup(m.secret).key.tenant for m in made} == {"t0", "t1", "t2"}  # type: ignore[union-attr]
    finally:
        await writer.aclose()
        await reader.aclose()
