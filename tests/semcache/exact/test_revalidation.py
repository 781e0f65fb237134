"""Stale-while-revalidate: one background refresh per key, also when a lookup that read the
stale answer ends only after the previous refresh stored the fresh one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Self

import orjson
import pytest
from prometheus_client import CollectorRegistry

from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheStatus, ExactCache
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule
from semcache.tiers import MemoryStore, Store
from tests.semcache import payloads
from tests.support.stepped_clock import SteppedClock

MODEL = payloads.MODEL
RULE = CacheRule(ttl_s=60, max_ttl_s=600, swr_s=30)


class HeldReads(Store[bytes]):
    """A byte tier whose next read, once ``hold`` is armed, takes the value at once and
    returns it only when the test releases it: a disk read or a Redis reply still on its
    way back while other tasks run."""

    tier = "disk"

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, bytes] = {}
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()

    async def get(self, key: str) -> bytes | None:
        value = self.values.get(key)
        if (hold := self.hold) is not None:
            self.hold = None
            self.holding.set()
            await hold.wait()
        return value

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> None:
        self.values.pop(key, None)

    async def clear(self) -> None:
        self.values.clear()

    def with_namespace(self, namespace: str) -> Self:
        return self


class Backend:
    """Counts calls; each call answers once ``open`` is set (``called`` says one came)."""

    def __init__(self) -> None:
        self.calls = 0
        self.open = asyncio.Event()
        self.open.set()
        self.called = asyncio.Event()

    async def fill(self) -> CachedAnswer:
        self.calls += 1
        self.called.set()
        await self.open.wait()
        return CachedAnswer.from_json(payloads.chat_json(f"answer #{self.calls}"), model_id=MODEL)


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def lower() -> HeldReads:
    return HeldReads()


@pytest.fixture
async def cache(
    clock: SteppedClock, registry: CollectorRegistry, lower: HeldReads
) -> AsyncIterator[ExactCache]:
    c = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size, clock=clock),
        lower=[lower],
        metrics=CacheMetrics(registry),
        clock=clock,
    )
    yield c
    await c.aclose()


async def prep(cache: ExactCache) -> CacheRequest:
    return await cache.prepare(
        route="chat",
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        model_id=MODEL,
        revision="rev-1",
        rule=RULE,
        tenant="acme",
    )


def content(answer: CachedAnswer | None) -> str:
    assert answer is not None and answer.body is not None
    return str(orjson.loads(answer.body)["choices"][0]["message"]["content"])


async def test_a_lookup_spanning_the_refresh_store_starts_no_second_refresh(
    cache: ExactCache, clock: SteppedClock, registry: CollectorRegistry, lower: HeldReads
) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill)
    clock.advance(RULE.ttl_s + 5)  # inside the SWR window

    backend.open.clear()
    backend.called.clear()
    first = await cache.get_or_fill(req, backend.fill)
    assert first.status is CacheStatus.STALE
    async with asyncio.timeout(10):
        await backend.called.wait()  # the refresh is waiting for its backend answer

    # the next lookup reads the stale entry from both tiers; the lower tier's reply is held
    lower.hold = release = asyncio.Event()
    late = asyncio.create_task(cache.get_or_fill(req, backend.fill))
    async with asyncio.timeout(10):
        await lower.holding.wait()

    backend.open.set()  # the refresh gets its answer, stores it and ends
    async with asyncio.timeout(10):
        await cache.wait_refreshes()
    assert backend.calls == 2
    assert (await cache.lookup(req)).status is CacheStatus.HIT

    release.set()  # the held lookup ends now, with the stale entry it read
    async with asyncio.timeout(10):
        served = await late
        await cache.wait_refreshes()
    assert served.status in (CacheStatus.STALE, CacheStatus.HIT)
    assert backend.calls == 2  # the first fill and one refresh, never a second
    hit = await cache.lookup(req)
    assert hit.status is CacheStatus.HIT and content(hit.entry) == "answer #2"
    refreshes = "semcache_exact_refreshes_total"
    assert registry.get_sample_value(refreshes, {"model": MODEL, "outcome": "stored"}) == 1
    fresh = {"model": MODEL, "outcome": "already_fresh"}
    assert registry.get_sample_value(refreshes, fresh) == 1  # found the key fresh, fetched nothing
