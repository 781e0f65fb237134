"""Epoch purges on one machine: each kind, persistence over a restart, several workers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheStatus, ExactCache
from semcache.exact.purge import LocalEpochs, model_field, tag_field
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule
from semcache.tiers import DiskStore, MemoryStore
from tests.semcache import payloads

RULE = CacheRule(ttl_s=600, max_ttl_s=600)
SHARED = CacheRule(ttl_s=600, max_ttl_s=600, shared=True)


def worker(directory: Path) -> ExactCache:
    """One gateway worker: its own L1, the machine's L2 and epochs."""
    return ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        lower=[DiskStore(directory / "l2")],
        epochs=LocalEpochs(directory / "l2" / "epochs"),
        metrics=CacheMetrics(CollectorRegistry()),
    )


@pytest.fixture
async def cache(tmp_path: Path) -> AsyncIterator[ExactCache]:
    c = worker(tmp_path)
    yield c
    await c.aclose()


async def fill() -> CachedAnswer:
    return CachedAnswer.from_json(payloads.chat_json(), model_id=payloads.MODEL)


async def req(
    cache: ExactCache,
    text: str,
    *,
    model: str = "m1",
    tenant: str = "acme",
    tags: tuple[str, ...] = (),
    rule: CacheRule = RULE,
) -> CacheRequest:
    return await cache.prepare(
        route="chat",
        body={"messages": [{"role": "user", "content": text}], "temperature": 0},
        model_id=model,
        revision="r1",
        rule=rule,
        tenant=tenant,
        tags=tags,
    )


async def status(cache: ExactCache, text: str, **kw: Any) -> CacheStatus:
    return (await cache.lookup(await req(cache, text, **kw))).status


async def seed(cache: ExactCache) -> None:
    for r in [
        await req(cache, "a"),
        await req(cache, "b", model="m2"),
        await req(cache, "c", tenant="globex"),
        await req(cache, "d", tags=("faq",)),
        await req(cache, "e", tags=("faq", "pricing")),
        await req(cache, "f", rule=SHARED),
    ]:
        assert (await cache.get_or_fill(r, fill)).stored


async def test_purge_model(cache: ExactCache) -> None:
    await seed(cache)
    result = await cache.purge("model", "m1")
    assert result.kind == "model" and result.propagated
    assert await status(cache, "a") is CacheStatus.MISS
    assert await status(cache, "d", tags=("faq",)) is CacheStatus.MISS
    assert await status(cache, "b", model="m2") is CacheStatus.HIT


async def test_purge_tenant(cache: ExactCache) -> None:
    await seed(cache)
    await cache.purge("tenant", "acme")
    assert await status(cache, "a") is CacheStatus.MISS
    assert await status(cache, "c", tenant="globex") is CacheStatus.HIT
    assert await status(cache, "f", rule=SHARED) is CacheStatus.HIT  # shared: not acme's
    await cache.purge("scope", "shared")
    assert await status(cache, "f", rule=SHARED) is CacheStatus.MISS


async def test_purge_tag(cache: ExactCache) -> None:
    await seed(cache)
    await cache.purge("tag", "pricing")
    assert await status(cache, "e", tags=("faq", "pricing")) is CacheStatus.MISS
    assert await status(cache, "d", tags=("faq",)) is CacheStatus.HIT
    # The same request stored again after the purge is served again.
    r = await req(cache, "e", tags=("faq", "pricing"))
    await cache.get_or_fill(r, fill)
    assert (await cache.lookup(r)).status is CacheStatus.HIT
    await cache.purge("tag", "faq")
    assert await status(cache, "d", tags=("faq",)) is CacheStatus.MISS
    assert await status(cache, "e", tags=("faq", "pricing")) is CacheStatus.MISS
    assert await status(cache, "a") is CacheStatus.HIT


async def test_purge_key_by_short_id_and_by_digest(cache: ExactCache) -> None:
    """(A request snapshots the epochs when it is prepared, so each check prepares anew.)"""
    await seed(cache)
    a = await req(cache, "a")
    await cache.purge("key", a.key.short_id)
    assert await status(cache, "a") is CacheStatus.MISS
    assert await status(cache, "b", model="m2") is CacheStatus.HIT

    b = await req(cache, "b", model="m2")
    await cache.purge("key", b.key.digest)
    assert await status(cache, "b", model="m2") is CacheStatus.MISS
    assert await cache.lower[0].get(b.key.digest) is None  # also deleted from the tiers
    with pytest.raises(ValueError):
        await cache.purge("key", "xyz")
    with pytest.raises(ValueError):
        await cache.purge("everything")


async def test_purge_all_clears_every_tier(cache: ExactCache) -> None:
    await seed(cache)
    a = await req(cache, "a")
    await cache.purge("all")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("a", {}),
        ("b", {"model": "m2"}),
        ("f", {"rule": SHARED}),
    ]
    for text, kw in cases:
        assert await status(cache, text, **kw) is CacheStatus.MISS
    assert cache.memory is not None and len(cache.memory) == 0
    assert await cache.lower[0].get(a.key.digest) is None


async def test_epochs_survive_a_restart(tmp_path: Path) -> None:
    first = worker(tmp_path)
    await seed(first)
    await first.purge("model", "m1")
    await first.purge("tag", "pricing")
    await first.aclose()

    book = LocalEpochs(tmp_path / "l2" / "epochs")
    snap = await book.snapshot()
    assert snap.get(model_field("m1")) == 1 and snap.get(tag_field("pricing")) == 1
    await book.aclose()

    restarted = worker(tmp_path)  # empty L1, same L2 and epochs
    try:
        assert await status(restarted, "a") is CacheStatus.MISS
        assert await status(restarted, "e", tags=("faq", "pricing")) is CacheStatus.MISS
        assert await status(restarted, "b", model="m2") is CacheStatus.HIT
    finally:
        await restarted.aclose()


async def test_workers_of_one_machine_see_a_purge_at_once(tmp_path: Path) -> None:
    one, two = worker(tmp_path), worker(tmp_path)
    try:
        r1 = await req(one, "a", tags=("faq",))
        await one.get_or_fill(r1, fill)
        r2 = await req(two, "a", tags=("faq",))
        assert (await two.lookup(r2)).tier == "disk"
        assert (await two.lookup(r2)).tier == "memory"  # now in worker two's own L1

        await one.purge("tag", "faq")
        assert (await two.lookup(await req(two, "a", tags=("faq",)))).status is (CacheStatus.MISS)
        await one.purge("model", "m1")
        await one.get_or_fill(await req(one, "b"), fill)
        assert (await two.lookup(await req(two, "b"))).status is CacheStatus.HIT
        await one.purge("model", "m1")
        assert (await two.lookup(await req(two, "b"))).status is CacheStatus.MISS
    finally:
        await one.aclose()
        await two.aclose()
