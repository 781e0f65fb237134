"""L3 on a real redis-server: the store, purges across gateways, and surviving an outage."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster

from harness.ports import free_port
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheStatus, ExactCache
from semcache.exact.purge import LocalEpochs, RedisEpochs
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule
from semcache.tiers import DiskStore, MemoryStore, RedisLink, RedisStore
from tests.semcache import payloads
from tests.semcache.conftest import RedisServer
from tests.support.stepped_clock import SteppedClock
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow

RULE = CacheRule(ttl_s=600, max_ttl_s=600)


class Gateway:
    """One gateway: its own L1 (and optionally L2) plus the shared Redis L3 and epochs."""

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        disk: Path | None = None,
        recheck_s: float = 0.0,
        retry_after_s: float = 0.05,
    ) -> None:
        self.link = RedisLink(
            url, prefix=prefix, timeout_s=0.25, retry_after_s=retry_after_s, max_retry_after_s=0.2
        )
        self.l3 = RedisStore(self.link)
        lower: list[Any] = [DiskStore(disk)] if disk is not None else []
        self.book = RedisEpochs(
            self.link, LocalEpochs(disk / "epochs" if disk else None), recheck_s=recheck_s
        )
        self.registry = CollectorRegistry()
        self.cache = ExactCache(
            memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
            lower=[*lower, self.l3],
            epochs=self.book,
            metrics=CacheMetrics(self.registry),
            links=[self.link],
        )
        self.fills = 0

    async def fill(self) -> CachedAnswer:
        self.fills += 1
        return CachedAnswer.from_json(payloads.chat_json(), model_id=payloads.MODEL)

    async def req(
        self, text: str, *, model: str = "m1", tenant: str = "acme", tags: tuple[str, ...] = ()
    ) -> CacheRequest:
        return await self.cache.prepare(
            route="chat",
            body={"messages": [{"role": "user", "content": text}], "seed": 1},
            model_id=model,
            revision="r1",
            rule=RULE,
            tenant=tenant,
            tags=tags,
        )

    async def ask(self, text: str, **kw: Any) -> tuple[CacheStatus, str | None]:
        result = await self.cache.get_or_fill(await self.req(text, **kw), self.fill)
        return result.status, result.tier


@pytest.fixture
async def gateways(
    shared_redis_url: str, redis_prefix: str
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    one, two = Gateway(shared_redis_url, redis_prefix), Gateway(shared_redis_url, redis_prefix)
    await one.cache.start()
    await two.cache.start()
    yield one, two
    await one.cache.aclose()
    await two.cache.aclose()


# --------------------------------------------------------------------------- the store


async def test_redis_store_operations(shared_redis_url: str, redis_prefix: str) -> None:
    link = RedisLink(shared_redis_url, prefix=redis_prefix)
    try:
        store = RedisStore(link, namespace="exact")
        await store.set("a", b"1")
        await store.set("b", b"2", ttl_s=0.05)
        assert await store.get("a") == b"1" and await store.get("b") == b"2"
        # Redis expires the key on its own clock: check the expiry the store gave it.
        assert 0 < await link.client.pttl(link.key("exact/b")) <= 50
        assert await link.client.pttl(link.key("exact/a")) == -1  # no TTL: kept
        await store.set("c", b"3")
        await store.delete_many(["a", "c", "missing"])
        assert await store.get("a") is None and await store.get("c") is None

        child = store.with_namespace("child")
        other = RedisStore(link, namespace="other")
        await store.set("k", b"x")
        await child.set("k", b"y")
        await other.set("k", b"z")
        assert await child.get("k") == b"y"
        await store.clear()
        assert await store.get("k") is None and await child.get("k") is None
        assert await other.get("k") == b"z"
        await other.clear()
    finally:
        await link.aclose()


async def test_unreachable_redis_is_a_quiet_miss(caplog: pytest.LogCaptureFixture) -> None:
    clock = SteppedClock(1000.0)
    link = RedisLink(
        f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1, retry_after_s=0.05, clock=clock
    )
    store = RedisStore(link)
    caplog.set_level(logging.WARNING, logger="semcache.tiers.redis")
    try:
        for _ in range(20):  # 0.2 s of the link's time: it probes the server again, and again
            assert await store.get("k") is None
            await store.set("k", b"v")
            await store.delete("k")
            clock.now += 0.01
        assert not link.available
        outage_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(outage_logs) == 1
    finally:
        await link.aclose()


# --------------------------------------------------------------------------- two gateways


async def test_gateways_share_answers_through_l3(gateways: tuple[Gateway, Gateway]) -> None:
    one, two = gateways
    assert (await one.ask("q"))[0] is CacheStatus.MISS
    assert await two.ask("q") == (CacheStatus.HIT, "redis")
    assert await two.ask("q") == (CacheStatus.HIT, "memory")
    assert one.fills == 1 and two.fills == 0


@pytest.mark.parametrize(
    ("kind", "target", "ask_kw"),
    [
        ("model", "m1", {}),
        ("tenant", "acme", {}),
        ("tag", "faq", {"tags": ("faq",)}),
        ("all", "", {}),
        ("key", "", {}),
    ],
)
async def test_a_purge_stops_every_gateway_at_once(
    gateways: tuple[Gateway, Gateway], kind: str, target: str, ask_kw: dict[str, Any]
) -> None:
    one, two = gateways
    await one.ask("q", **ask_kw)
    await two.ask("q", **ask_kw)
    assert await two.ask("q", **ask_kw) == (CacheStatus.HIT, "memory")  # in two's own L1
    untouched = await one.ask("other", model="m2", tenant="globex")
    assert untouched[0] is CacheStatus.MISS

    if kind == "key":
        target = (await one.req("q", **ask_kw)).key.short_id
    result = await one.cache.purge(kind, target)
    assert result.propagated

    fills = two.fills
    status, _ = await two.ask("q", **ask_kw)  # immediately: no wait, no stale L1
    assert status is CacheStatus.MISS and two.fills == fills + 1
    expected_other = CacheStatus.MISS if kind == "all" else CacheStatus.HIT
    assert (await two.ask("other", model="m2", tenant="globex"))[0] is expected_other


async def test_pubsub_pushes_bumps_when_reads_do_not_recheck(
    shared_redis_url: str, redis_prefix: str
) -> None:
    one = Gateway(shared_redis_url, redis_prefix)
    lazy = Gateway(shared_redis_url, redis_prefix, recheck_s=3600)
    await one.cache.start()
    await lazy.cache.start()
    try:
        await lazy.ask("q")  # the first read fetches the epochs once
        assert (await lazy.ask("q"))[0] is CacheStatus.HIT

        async def both_listening() -> bool:  # one's listener and lazy's
            return await subscribers(lazy) == 2

        await wait_until_async(both_listening, timeout_s=10.0, interval_s=0.05)
        await one.cache.purge("model", "m1")
        await wait_until_async(lambda: lazy.book.messages, timeout_s=2.0)
        assert lazy.book.messages == 1
        assert (await lazy.ask("q"))[0] is CacheStatus.MISS
    finally:
        await one.cache.aclose()
        await lazy.cache.aclose()


# --------------------------------------------------------------------------- outage


async def subscribers(gateway: Gateway) -> int:
    """Clients subscribed to ``gateway``'s purge-epoch channel (its own listener among them)."""
    client = gateway.link.client
    if isinstance(client, RedisCluster):  # subscribers are counted per node: ask them all
        numsub = client.pubsub_numsub(gateway.book.channel, target_nodes=RedisCluster.ALL_NODES)
    else:
        numsub = client.pubsub_numsub(gateway.book.channel)
    ((_, count),) = await numsub
    return int(count)


async def test_redis_killed_mid_test_then_back(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    server = redis_factory()
    gw = Gateway(server.url, redis_prefix, disk=tmp_path / "l2")
    peer = Gateway(server.url, redis_prefix)
    await gw.cache.start()
    await peer.cache.start()
    try:
        assert (await gw.ask("before"))[0] is CacheStatus.MISS
        assert await gw.ask("before") == (CacheStatus.HIT, "memory")

        server.stop()
        # Still serving from L1 and L2, no exception, backend for new questions.
        assert await gw.ask("before") == (CacheStatus.HIT, "memory")
        assert (await gw.ask("during"))[0] is CacheStatus.MISS
        assert gw.cache.memory is not None
        await gw.cache.memory.clear()
        assert await gw.ask("during") == (CacheStatus.HIT, "disk")
        assert await gw.ask("before") == (CacheStatus.HIT, "disk")
        assert not gw.link.available

        # A purge while Redis is down applies here and is re-sent later.
        result = await gw.cache.purge("tag", "offline")
        assert not result.propagated

        server.start()  # same port, empty (no persistence)

        async def l3_back() -> bool:
            await gw.ask("probe")
            return gw.link.available

        await wait_until_async(l3_back, timeout_s=10.0, interval_s=0.05)
        await gw.ask("after")
        after = await gw.req("after")
        assert await gw.l3.get(after.key.digest) is not None  # written to Redis again
        assert await peer.ask("after") == (CacheStatus.HIT, "redis")

        # The offline purge reached Redis, so the peer sees it too.
        snap = await peer.book.snapshot()
        assert snap.get("tag:offline") >= 1
    finally:
        await gw.cache.aclose()
        await peer.cache.aclose()


async def test_a_purge_after_redis_lost_its_epochs_still_counts(
    redis_factory: Callable[[], RedisServer], redis_prefix: str
) -> None:
    """Redis restarts empty: epochs restart from the highest any gateway has seen."""
    server = redis_factory()
    gw, peer = Gateway(server.url, redis_prefix), Gateway(server.url, redis_prefix)
    await gw.cache.start()
    await peer.cache.start()
    try:
        await peer.cache.purge("model", "m1")  # model:m1 = 1 everywhere
        await gw.ask("q")
        assert await gw.ask("q") == (CacheStatus.HIT, "memory")

        server.stop()
        server.start()  # no persistence: the epochs hash is gone

        async def both_back() -> bool:
            await gw.ask("probe")
            await peer.ask("probe")
            return gw.link.available and peer.link.available

        await wait_until_async(both_back, timeout_s=10.0, interval_s=0.05)
        assert (await peer.cache.purge("model", "m1")).propagated
        assert (await gw.ask("q"))[0] is CacheStatus.MISS
    finally:
        await gw.cache.aclose()
        await peer.cache.aclose()
