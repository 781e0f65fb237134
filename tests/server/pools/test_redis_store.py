"""The pool membership store on a real Redis: one change per server (the latest replaces the
earlier), read back by another gateway's store, and a change told to every follower."""

from __future__ import annotations

import asyncio

import pytest

from server.pools.records import MemberChange
from server.pools.redis_store import RedisMembershipStore
from tests.semcache.conftest import RedisServer
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow


def change(url: str, state: str, at: float) -> MemberChange:
    return MemberChange(backend="tiny", role="decode", url=url, state=state, at=at)  # type: ignore[arg-type]


async def test_changes_are_shared_and_told_to_every_follower(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    one = RedisMembershipStore(redis_server.url, redis_prefix)
    two = RedisMembershipStore(redis_server.url, redis_prefix)
    told: list[int] = []
    subscribed = asyncio.Event()

    async def changed() -> None:
        told.append(len(await two.load_all()))
        subscribed.set()

    follower = asyncio.create_task(two.watch(changed))
    try:
        await asyncio.wait_for(subscribed.wait(), 10)  # told once at subscription
        assert told == [0]
        await one.put(change("http://10.0.0.1:8000", "added", 1.0))
        await one.put(change("http://10.0.0.2:8000", "added", 2.0))
        await one.put(change("http://10.0.0.1:8000/", "drained", 3.0))
        await wait_until_async(lambda: len(told) == 4, timeout_s=5)
        found = sorted(await two.load_all(), key=lambda c: c.at)
        assert [(c.url, c.state) for c in found] == [
            ("http://10.0.0.2:8000", "added"),
            ("http://10.0.0.1:8000/", "drained"),
        ]
        other = RedisMembershipStore(redis_server.url, f"{redis_prefix}-other")
        assert await other.load_all() == []  # another prefix, another fleet
        await other.aclose()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await one.aclose()
        await two.aclose()
