"""The exact cache over real memory and disk tiers: lookup, fill, SWR, coalescing, control."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from prometheus_client import CollectorRegistry

from semcache.entry import CachedAnswer
from semcache.exact import (
    CacheControl,
    CacheRequest,
    CacheResult,
    CacheStatus,
    ExactCache,
    Flight,
    open_exact_cache,
)
from semcache.exact.purge import LocalEpochs
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule, DiskTier, MemoryTier, Prices, TierSettings
from semcache.tiers import DiskStore, MemoryStore, Store
from tests.semcache import payloads
from tests.support.stepped_clock import SteppedClock

MODEL = payloads.MODEL
RULE = CacheRule(
    ttl_s=60, max_ttl_s=600, swr_s=30, prices=Prices(input_per_m=0.045, output_per_m=0.384)
)


class Backend:
    """Counts calls; answers with a realistic chat completion naming the prompt.

    With a ``gate``, each call waits until the test opens it (a backend still answering).
    """

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.calls = 0
        self.gate = gate

    def fill_for(self, text: str, *, tenant: str = "") -> Callable[[], Awaitable[CachedAnswer]]:
        async def fill() -> CachedAnswer:
            self.calls += 1
            if self.gate is not None:
                await self.gate.wait()
            content = f"answer to {text} for {tenant} #{self.calls}"
            return CachedAnswer.from_json(payloads.chat_json(content), model_id=MODEL)

        return fill


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) for a condition that other tasks make true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never became true"
        await asyncio.sleep(0.001)


def content(answer: CachedAnswer | None) -> str:
    assert answer is not None and answer.body is not None
    return str(orjson.loads(answer.body)["choices"][0]["message"]["content"])


def body(text: str = "Capital of France?", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **extra,
    }


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock(1_700_000_000.0)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def cache(
    tmp_path: Path, clock: SteppedClock, registry: CollectorRegistry
) -> AsyncIterator[ExactCache]:
    """Memory (L1) + disk (L2), epochs persisted next to the disk tier."""
    c = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        lower=[DiskStore(tmp_path / "l2")],
        epochs=LocalEpochs(tmp_path / "l2" / "epochs"),
        metrics=CacheMetrics(registry),
        clock=clock,
    )
    yield c
    await c.aclose()


@pytest.fixture
async def mem_cache(clock: SteppedClock, registry: CollectorRegistry) -> AsyncIterator[ExactCache]:
    """Memory only: lookups never suspend, so concurrent tasks interleave deterministically."""
    c = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        metrics=CacheMetrics(registry),
        clock=clock,
    )
    yield c
    await c.aclose()


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def prep(
    cache: ExactCache,
    text: str = "Capital of France?",
    *,
    tenant: str = "acme",
    rule: CacheRule = RULE,
    control: CacheControl | None = None,
    **extra: Any,
) -> CacheRequest:
    return await cache.prepare(
        route="chat",
        body=body(text, **extra),
        model_id=MODEL,
        revision="rev-1",
        rule=rule,
        tenant=tenant,
        control=control,
    )


# --------------------------------------------------------------------------- basics


async def test_miss_then_hit_with_age(cache: ExactCache, clock: SteppedClock) -> None:
    backend = Backend()
    req = await prep(cache)
    first = await cache.get_or_fill(req, backend.fill_for("q"))
    assert first.status is CacheStatus.MISS and first.stored and backend.calls == 1
    clock.now += 7.5
    second = await cache.get_or_fill(req, backend.fill_for("q"))
    assert second.status is CacheStatus.HIT and second.tier == "memory"
    assert second.age == 7 and backend.calls == 1
    assert content(second.entry) == content(first.entry)
    assert second.key.short_id == req.key.digest[:12]


async def test_a_fresh_hit_is_found_uncounted_until_counted(
    cache: ExactCache, clock: SteppedClock, registry: CollectorRegistry
) -> None:
    backend = Backend()
    req = await prep(cache)
    assert await cache.fresh_hit(req) is None  # a miss: nothing found, nothing counted
    assert metric(registry, "semcache_exact_misses_total", model=MODEL) == 0
    filled = await cache.get_or_fill(req, backend.fill_for("q"))
    misses = metric(registry, "semcache_exact_misses_total", model=MODEL)
    clock.now += 3
    found = await cache.fresh_hit(req)
    assert found is not None and found.status is CacheStatus.HIT and found.age == 3
    assert content(found.entry) == content(filled.entry)
    assert metric(registry, "semcache_exact_hits_total", model=MODEL, tier="memory") == 0
    cache.count(req, found, time.perf_counter())
    assert metric(registry, "semcache_exact_hits_total", model=MODEL, tier="memory") == 1
    bypass = await prep(cache, control=CacheControl(bypass_read=True))
    assert await cache.fresh_hit(bypass) is None
    clock.now += RULE.ttl_s  # stale: the route serves it and schedules the refresh
    assert await cache.fresh_hit(req) is None
    assert metric(registry, "semcache_exact_misses_total", model=MODEL) == misses
    assert metric(registry, "semcache_exact_bypasses_total", model=MODEL) == 0
    assert backend.calls == 1


async def test_lower_tier_hit_fills_the_tiers_above(cache: ExactCache) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    assert cache.memory is not None
    await cache.memory.clear()
    from_disk = await cache.lookup(req)
    assert from_disk.status is CacheStatus.HIT and from_disk.tier == "disk"
    again = await cache.lookup(req)
    assert again.tier == "memory"
    assert content(again.entry) == content(from_disk.entry)


async def test_checksum_failure_is_a_counted_miss(
    cache: ExactCache, registry: CollectorRegistry
) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    disk = cache.lower[0]
    assert isinstance(disk, DiskStore) and cache.memory is not None
    blob = bytearray(await disk.get(req.key.digest) or b"")
    blob[-5] ^= 0xFF  # one flipped bit pattern in the answer bytes
    await disk.set(req.key.digest, bytes(blob))
    await cache.memory.clear()

    result = await cache.get_or_fill(req, backend.fill_for("q"))
    assert result.status is CacheStatus.MISS and backend.calls == 2
    assert metric(registry, "semcache_exact_integrity_failures_total", tier="disk") == 1
    # The damaged entry was dropped and replaced by the new answer.
    assert (await cache.lookup(req)).status is CacheStatus.HIT


async def test_entry_under_another_key_fails_the_check(
    cache: ExactCache, registry: CollectorRegistry
) -> None:
    backend = Backend()
    a = await prep(cache, "question A")
    b = await prep(cache, "question B")
    await cache.get_or_fill(a, backend.fill_for("A"))
    disk = cache.lower[0]
    await disk.set(b.key.digest, await disk.get(a.key.digest) or b"")
    assert (await cache.lookup(b)).status is CacheStatus.MISS
    assert metric(registry, "semcache_exact_integrity_failures_total", tier="disk") == 1


async def test_expired_after_the_swr_window(cache: ExactCache, clock: SteppedClock) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    clock.now += RULE.ttl_s + RULE.swr_s + 1
    result = await cache.get_or_fill(req, backend.fill_for("q"))
    assert result.status is CacheStatus.EXPIRED and backend.calls == 2 and result.stored
    assert (await cache.lookup(req)).status is CacheStatus.HIT


# --------------------------------------------------------------------------- SWR


async def test_stale_is_served_at_once_and_refreshed_exactly_once(
    cache: ExactCache, clock: SteppedClock, registry: CollectorRegistry
) -> None:
    backend = Backend()
    req = await prep(cache)
    first = await cache.get_or_fill(req, backend.fill_for("q"))
    clock.now += RULE.ttl_s + 5  # inside the SWR window

    backend.gate = asyncio.Event()  # the refresh is still running while the 20 are served
    async with asyncio.timeout(10):  # at once: none of them waits for the refresh
        results = await asyncio.gather(
            *(cache.get_or_fill(req, backend.fill_for("q")) for _ in range(20))
        )
    backend.gate.set()
    assert {r.status for r in results} == {CacheStatus.STALE}
    assert all(content(r.entry) == content(first.entry) for r in results)
    await cache.wait_refreshes()
    assert backend.calls == 2  # the first fill and exactly one refresh
    assert metric(registry, "semcache_exact_refreshes_total", model=MODEL, outcome="stored") == 1

    clock.now += 1
    fresh = await cache.get_or_fill(req, backend.fill_for("q"))
    assert fresh.status is CacheStatus.HIT and fresh.age == 1
    assert content(fresh.entry) != content(first.entry)


async def test_failed_refresh_keeps_serving_stale(cache: ExactCache, clock: SteppedClock) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    clock.now += RULE.ttl_s + 1

    async def broken() -> CachedAnswer:
        raise ConnectionError("backend down")

    assert (await cache.get_or_fill(req, broken)).status is CacheStatus.STALE
    await cache.wait_refreshes()
    assert (await cache.get_or_fill(req, broken)).status is CacheStatus.STALE


# --------------------------------------------------------------------------- coalescing


async def test_fifty_concurrent_identical_misses_make_one_backend_call(
    cache: ExactCache, registry: CollectorRegistry
) -> None:
    backend = Backend(gate=asyncio.Event())
    req = await prep(cache)
    missed = 0
    lookup = cache.lookup

    async def counted_lookup(r: CacheRequest) -> CacheResult:
        nonlocal missed
        result = await lookup(r)
        missed += 1  # from here a caller leads or joins the flight without suspending
        return result

    cache.lookup = counted_lookup  # type: ignore[method-assign]
    running = asyncio.gather(*(cache.get_or_fill(req, backend.fill_for("q")) for _ in range(50)))
    await until(lambda: missed == 50)  # every caller is in the one flight: the backend answers
    backend.gate.set()
    results = await running
    assert backend.calls == 1
    assert len({content(r.entry) for r in results}) == 1
    assert sum(r.coalesced for r in results) == 49
    assert sum(r.stored for r in results) == 1


async def test_a_failing_fill_fails_every_waiter_once(mem_cache: ExactCache) -> None:
    calls = 0

    async def broken() -> CachedAnswer:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)  # the others join meanwhile (memory lookups never suspend)
        raise ConnectionError("backend refused")

    req = await prep(mem_cache)
    results = await asyncio.gather(
        *(mem_cache.get_or_fill(req, broken) for _ in range(20)), return_exceptions=True
    )
    assert calls == 1
    assert all(isinstance(r, ConnectionError) for r in results)
    assert (await mem_cache.lookup(req)).status is CacheStatus.MISS


async def test_an_incomplete_answer_makes_a_waiter_fill_again(mem_cache: ExactCache) -> None:
    calls = 0

    async def flaky() -> CachedAnswer | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)  # the others join meanwhile (memory lookups never suspend)
        if calls == 1:
            return None  # the leader's stream was cut
        return CachedAnswer.from_json(payloads.chat_json("complete"), model_id=MODEL)

    req = await prep(mem_cache)
    results = await asyncio.gather(*(mem_cache.get_or_fill(req, flaky) for _ in range(20)))
    assert calls == 2
    assert sum(r.entry is None for r in results) == 1
    assert {content(r.entry) for r in results if r.entry is not None} == {"complete"}
    assert (await mem_cache.lookup(req)).status is CacheStatus.HIT


async def test_a_cancelled_leader_hands_over_to_a_waiter(mem_cache: ExactCache) -> None:
    backend = Backend(gate=asyncio.Event())
    req = await prep(mem_cache)
    leader = asyncio.create_task(mem_cache.get_or_fill(req, backend.fill_for("q")))
    await asyncio.sleep(0)  # the leader is now inside its fill
    waiters = [
        asyncio.create_task(mem_cache.get_or_fill(req, backend.fill_for("q"))) for _ in range(5)
    ]
    await asyncio.sleep(0)
    leader.cancel()
    backend.gate.set()  # the waiter that takes over gets its answer
    results = await asyncio.gather(*waiters)
    assert backend.calls == 2
    assert len({content(r.entry) for r in results}) == 1
    with pytest.raises(asyncio.CancelledError):
        await leader


async def test_error_answers_are_shared_but_not_stored(mem_cache: ExactCache) -> None:
    calls = 0

    async def bad_request() -> CachedAnswer:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)  # the others join meanwhile (memory lookups never suspend)
        return CachedAnswer(status=400, body=b'{"error": {"message": "bad"}}')

    req = await prep(mem_cache)
    results = await asyncio.gather(*(mem_cache.get_or_fill(req, bad_request) for _ in range(5)))
    assert calls == 1 and all(r.entry and r.entry.status == 400 for r in results)
    assert not any(r.stored for r in results)
    assert (await mem_cache.lookup(req)).status is CacheStatus.MISS


# ------------------------------------------------------------------ claim: leading in own task


def answer(text: str) -> CachedAnswer:
    return CachedAnswer.from_json(payloads.chat_json(text), model_id=MODEL)


async def test_claim_hands_a_miss_to_its_caller_and_joins_the_others(
    mem_cache: ExactCache,
) -> None:
    req = await prep(mem_cache)
    never: Any = None  # no refresh can be asked for: nothing is stale
    flight = await mem_cache.claim(req, never)
    assert isinstance(flight, Flight) and flight.result.status is CacheStatus.MISS
    waiters = [asyncio.create_task(mem_cache.claim(req, never)) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)  # they wait for the leader's answer
    res = await flight.finish(answer("led"))
    assert res.stored and content(res.entry) == "led" and not res.coalesced
    joined = await asyncio.gather(*waiters)
    assert all(isinstance(r, CacheResult) and r.coalesced for r in joined)
    assert {content(r.entry) for r in joined if isinstance(r, CacheResult)} == {"led"}
    hit = await mem_cache.claim(req, never)
    assert isinstance(hit, CacheResult) and hit.status is CacheStatus.HIT
    with pytest.raises(RuntimeError):
        await flight.finish(answer("twice"))  # a flight ends once


async def test_a_failed_flight_hands_its_error_to_the_waiters(mem_cache: ExactCache) -> None:
    req = await prep(mem_cache)
    flight = await mem_cache.claim(req, Backend().fill_for("q"))
    assert isinstance(flight, Flight)
    waiter = asyncio.create_task(mem_cache.claim(req, Backend().fill_for("q")))
    await asyncio.sleep(0)
    flight.fail(ConnectionError("backend down"))
    with pytest.raises(ConnectionError, match="backend down"):
        await waiter
    again = await mem_cache.claim(req, Backend().fill_for("q"))
    assert isinstance(again, Flight)  # nothing was stored, the key is free to lead again
    again.fail(ConnectionError("still down"))


@pytest.mark.parametrize("how", ["cancelled", "incomplete"])
async def test_a_cancelled_or_incomplete_flight_makes_a_waiter_the_leader(
    mem_cache: ExactCache, how: str
) -> None:
    req = await prep(mem_cache)
    fill = Backend().fill_for("q")
    flight = await mem_cache.claim(req, fill)
    assert isinstance(flight, Flight)
    waiter = asyncio.create_task(mem_cache.claim(req, fill))
    await asyncio.sleep(0)
    if how == "cancelled":
        flight.fail(asyncio.CancelledError())
    else:
        res = await flight.finish(None)
        assert res.entry is None and not res.stored
    successor = await waiter
    assert isinstance(successor, Flight)
    assert (await successor.finish(answer("second"))).stored
    assert (await mem_cache.lookup(req)).status is CacheStatus.HIT


async def test_an_uncacheable_claim_leads_alone_and_stores_nothing(
    mem_cache: ExactCache,
) -> None:
    off = msgspec.structs.replace(RULE, cacheable=False)
    req = await prep(mem_cache, rule=off)
    fill = Backend().fill_for("q")
    first, second = await asyncio.gather(mem_cache.claim(req, fill), mem_cache.claim(req, fill))
    assert isinstance(first, Flight) and isinstance(second, Flight)  # each its own sample
    res = await first.finish(answer("own"))
    assert res.status is CacheStatus.BYPASS and not res.stored
    second.fail(ConnectionError("ignored: nobody waits"))
    assert (await mem_cache.lookup(req)).status is CacheStatus.BYPASS


async def test_a_stale_claim_serves_and_refreshes_with_the_given_fill(
    mem_cache: ExactCache, clock: SteppedClock
) -> None:
    backend = Backend()
    req = await prep(mem_cache)
    await mem_cache.get_or_fill(req, backend.fill_for("q"))
    clock.now += RULE.ttl_s + 1
    stale = await mem_cache.claim(req, backend.fill_for("q"))
    assert isinstance(stale, CacheResult) and stale.status is CacheStatus.STALE
    await mem_cache.wait_refreshes()
    assert backend.calls == 2
    fresh = await mem_cache.lookup(req)
    assert fresh.status is CacheStatus.HIT and content(fresh.entry).endswith("#2")


# --------------------------------------------------------------------------- request control


async def test_bypass_read_goes_to_the_backend_and_stores(cache: ExactCache) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    no_cache = await prep(cache, control=CacheControl(bypass_read=True))
    result = await cache.get_or_fill(no_cache, backend.fill_for("q"))
    assert result.status is CacheStatus.BYPASS and backend.calls == 2 and result.stored
    hit = await cache.lookup(req)
    assert content(hit.entry) == content(result.entry)


async def test_no_store_and_skip_cache(cache: ExactCache) -> None:
    backend = Backend()
    no_store = await prep(cache, control=CacheControl(no_store=True))
    result = await cache.get_or_fill(no_store, backend.fill_for("q"))
    assert result.status is CacheStatus.MISS and not result.stored
    skip = await prep(cache, control=CacheControl(bypass_read=True, no_store=True))
    result = await cache.get_or_fill(skip, backend.fill_for("q"))
    assert result.status is CacheStatus.BYPASS and not result.stored
    assert (await cache.lookup(await prep(cache))).status is CacheStatus.MISS
    assert backend.calls == 2


async def test_request_ttl_is_bounded_by_max_ttl(cache: ExactCache, clock: SteppedClock) -> None:
    backend = Backend()
    longer = await prep(cache, control=CacheControl(ttl_s=10_000))
    await cache.get_or_fill(longer, backend.fill_for("q"))
    hit = await cache.lookup(longer)
    assert hit.entry is not None and hit.entry.ttl_s == RULE.max_ttl_s
    shorter = await prep(cache, "other", control=CacheControl(ttl_s=5))
    await cache.get_or_fill(shorter, backend.fill_for("other"))
    clock.now += 6
    assert (await cache.lookup(shorter)).status is CacheStatus.STALE


async def test_max_age_refuses_older_answers_and_stale(
    cache: ExactCache, clock: SteppedClock
) -> None:
    backend = Backend()
    req = await prep(cache)
    await cache.get_or_fill(req, backend.fill_for("q"))
    clock.now += 20
    strict = await prep(cache, control=CacheControl(max_age_s=10))
    assert (await cache.lookup(strict)).status is CacheStatus.EXPIRED
    assert (await cache.lookup(req)).status is CacheStatus.HIT
    clock.now += RULE.ttl_s
    assert (await cache.lookup(req)).status is CacheStatus.STALE
    assert (await cache.lookup(strict)).status is CacheStatus.EXPIRED


async def test_sampled_requests_bypass_unless_the_policy_widens(
    mem_cache: ExactCache, registry: CollectorRegistry
) -> None:
    backend = Backend(gate=asyncio.Event())
    sampled = await prep(mem_cache, temperature=0.8)
    assert not sampled.cacheable
    running = asyncio.gather(
        *(mem_cache.get_or_fill(sampled, backend.fill_for("q")) for _ in range(5))
    )
    await until(lambda: backend.calls == 5)  # all five at once: none waits for another
    backend.gate.set()
    results = await running
    assert {r.status for r in results} == {CacheStatus.BYPASS} and backend.calls == 5
    assert metric(registry, "semcache_exact_bypasses_total", model=MODEL) == 5

    wide = msgspec.structs.replace(RULE, deterministic_only=False)
    allowed = await prep(mem_cache, rule=wide, temperature=0.8)
    await mem_cache.get_or_fill(allowed, backend.fill_for("q"))
    assert (await mem_cache.get_or_fill(allowed, backend.fill_for("q"))).status is (CacheStatus.HIT)
    seeded = await prep(mem_cache, temperature=0.8, seed=11)
    assert seeded.cacheable


async def test_uncacheable_rule_bypasses(mem_cache: ExactCache) -> None:
    backend = Backend()
    off = msgspec.structs.replace(RULE, cacheable=False)
    req = await prep(mem_cache, rule=off)
    assert (await mem_cache.get_or_fill(req, backend.fill_for("q"))).status is CacheStatus.BYPASS
    assert (await mem_cache.get_or_fill(req, backend.fill_for("q"))).status is CacheStatus.BYPASS
    assert backend.calls == 2


async def test_custom_key_shares_an_answer_between_bodies(mem_cache: ExactCache) -> None:
    backend = Backend()
    a = await mem_cache.prepare(
        route="chat",
        body=body("How do I reset my password?"),
        model_id=MODEL,
        revision="rev-1",
        rule=RULE,
        tenant="acme",
        custom_key="faq-password",
    )
    b = await mem_cache.prepare(
        route="chat",
        body=body("password reset?"),
        model_id=MODEL,
        revision="rev-1",
        rule=RULE,
        tenant="acme",
        custom_key="faq-password",
    )
    await mem_cache.get_or_fill(a, backend.fill_for("a"))
    assert (await mem_cache.get_or_fill(b, backend.fill_for("b"))).status is CacheStatus.HIT


async def test_new_revision_never_serves_old_answers(mem_cache: ExactCache) -> None:
    backend = Backend()
    old = await prep(mem_cache)
    await mem_cache.get_or_fill(old, backend.fill_for("q"))
    new = await mem_cache.prepare(
        route="chat", body=body(), model_id=MODEL, revision="rev-2", rule=RULE, tenant="acme"
    )
    assert (await mem_cache.lookup(new)).status is CacheStatus.MISS


# --------------------------------------------------------------------------- metrics


async def test_hits_count_tokens_and_money_saved(
    mem_cache: ExactCache, registry: CollectorRegistry
) -> None:
    backend = Backend()
    req = await prep(mem_cache)
    await mem_cache.get_or_fill(req, backend.fill_for("q"))
    for _ in range(3):
        await mem_cache.get_or_fill(req, backend.fill_for("q"))
    # payloads.chat_json: 14 prompt and 8 completion tokens per answer
    assert metric(registry, "semcache_exact_hits_total", model=MODEL, tier="memory") == 3
    assert metric(registry, "semcache_exact_misses_total", model=MODEL) == 1
    assert (
        metric(registry, "semcache_exact_tokens_saved_total", model=MODEL, kind="prompt") == 3 * 14
    )
    assert (
        metric(registry, "semcache_exact_tokens_saved_total", model=MODEL, kind="completion")
        == 3 * 8
    )
    expected_usd = 3 * (14 * 0.045 + 8 * 0.384) / 1e6
    assert metric(registry, "semcache_exact_usd_saved_total", model=MODEL) == pytest.approx(
        expected_usd
    )
    assert metric(registry, "semcache_exact_served_bytes_total", model=MODEL, tier="memory") > 0


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("shared", [False, True])
async def test_randomized_cross_tenant_isolation(
    tmp_path: Path, clock: SteppedClock, shared: bool
) -> None:
    cache = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 22, sizeof=CachedAnswer.memory_size),
        lower=[DiskStore(tmp_path / "l2")],
        clock=clock,
    )
    rule = msgspec.structs.replace(RULE, shared=shared)
    rng = random.Random(1234 + shared)
    tenants = [f"tenant-{i}" for i in range(25)]
    prompts = [f"prompt {i}" for i in range(8)]
    backend = Backend()
    hits = 0
    try:
        for _ in range(400):
            tenant, prompt = rng.choice(tenants), rng.choice(prompts)
            req = await prep(cache, prompt, tenant=tenant, rule=rule)
            result = await cache.get_or_fill(req, backend.fill_for(prompt, tenant=tenant))
            text = content(result.entry)
            assert f"answer to {prompt} for" in text
            if result.status is CacheStatus.HIT:
                hits += 1
                if not shared:
                    assert text.split(" for ")[1].startswith(f"{tenant} #")
    finally:
        await cache.aclose()
    assert hits > 0
    distinct_pairs = len(prompts) if shared else None
    if shared:
        assert backend.calls == distinct_pairs
    else:
        assert backend.calls > len(prompts)


# --------------------------------------------------------------------------- factory


async def test_open_exact_cache_builds_the_tiers_from_policy(tmp_path: Path) -> None:
    tiers = TierSettings(memory=MemoryTier(max_bytes=1 << 20), disk=DiskTier(dir="cache/x"))
    cache = await open_exact_cache(tiers, data_dir=tmp_path, registry=CollectorRegistry())
    try:
        assert cache.tier_names == ["memory", "disk"]
        assert (tmp_path / "cache" / "x" / "epochs").is_dir()
        backend = Backend()
        req = await prep(cache)
        await cache.get_or_fill(req, backend.fill_for("q"))
        assert (await cache.lookup(req)).status is CacheStatus.HIT
    finally:
        await cache.aclose()
    no_tiers = TierSettings(memory=MemoryTier(max_bytes=0), disk=DiskTier(enabled=False))
    bare = await open_exact_cache(no_tiers, data_dir=tmp_path)
    try:
        req = await prep(bare)
        backend = Backend()
        await bare.get_or_fill(req, backend.fill_for("q"))
        assert (await bare.get_or_fill(req, backend.fill_for("q"))).status is CacheStatus.MISS
    finally:
        await bare.aclose()


async def test_stale_in_l1_prefers_a_fresh_copy_below(tmp_path: Path, clock: SteppedClock) -> None:
    """Another worker already refreshed the answer into the shared disk tier."""

    def worker() -> ExactCache:
        return ExactCache(
            memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
            lower=[DiskStore(tmp_path / "l2")],
            clock=clock,
        )

    one, two = worker(), worker()
    try:
        backend = Backend()
        r1, r2 = await prep(one), await prep(two)
        await one.get_or_fill(r1, backend.fill_for("q"))
        assert (await two.lookup(r2)).tier == "disk"  # now also in two's L1
        clock.now += RULE.ttl_s + 1
        refreshed = await one.get_or_fill(
            await prep(one, control=CacheControl(bypass_read=True)), backend.fill_for("q")
        )
        assert refreshed.stored
        result = await two.get_or_fill(r2, backend.fill_for("q"))
        assert result.status is CacheStatus.HIT and result.tier == "disk"
        assert content(result.entry) == content(refreshed.entry)
        assert backend.calls == 2  # no refresh by worker two
    finally:
        await one.aclose()
        await two.aclose()


class BrokenStore(Store[bytes]):
    """A byte tier whose every operation fails (a disk that went bad)."""

    tier = "disk"

    async def get(self, key: str) -> bytes | None:
        raise OSError("I/O error")

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        raise OSError("No space left on device")

    async def delete(self, key: str) -> None:
        raise OSError("I/O error")

    async def clear(self) -> None:
        raise OSError("I/O error")

    def with_namespace(self, namespace: str) -> BrokenStore:
        return self


async def test_a_failing_tier_is_a_miss_not_an_error(
    clock: SteppedClock, registry: CollectorRegistry
) -> None:
    cache = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        lower=[BrokenStore()],
        metrics=CacheMetrics(registry),
        clock=clock,
    )
    try:
        backend = Backend()
        req = await prep(cache)
        first = await cache.get_or_fill(req, backend.fill_for("q"))
        assert first.status is CacheStatus.MISS and first.stored
        assert (await cache.lookup(req)).tier == "memory"
        assert cache.memory is not None
        await cache.memory.clear()
        assert (await cache.lookup(req)).status is CacheStatus.MISS
        assert metric(registry, "semcache_exact_tier_errors_total", tier="disk", op="set") == 1
        assert metric(registry, "semcache_exact_tier_errors_total", tier="disk", op="get") == 2
    finally:
        await cache.aclose()


async def test_a_full_disk_is_logged_once_and_every_lost_write_counted(
    tmp_path: Path,
    clock: SteppedClock,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    disk = DiskStore(tmp_path / "l2", linger_s=0.0)
    cache = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        lower=[disk],
        metrics=CacheMetrics(registry),
        clock=clock,
        write_behind=True,
    )
    real_set = disk.cache.set

    def full(*args: Any, **kwargs: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    try:
        monkeypatch.setattr(disk.cache, "set", full)
        for i in range(5):
            res = await cache.get_or_fill(await prep(cache, f"q{i}"), Backend().fill_for("a"))
            assert res.stored  # in memory: still served
            await cache.flush()
        await cache.store(
            await prep(cache, "through"), CachedAnswer.from_json(b"{}"), write_through=True
        )
        assert metric(registry, "semcache_exact_tier_errors_total", tier="disk", op="set") == 6
        failed = [r for r in caplog.records if "cache tier disk failed on set" in r.message]
        assert len(failed) == 1
        monkeypatch.setattr(disk.cache, "set", real_set)
        await cache.get_or_fill(await prep(cache, "after"), Backend().fill_for("a"))
        await cache.flush()
        assert any("cache tier disk works again on set" in r.message for r in caplog.records)
        assert await disk.get((await prep(cache, "q0")).key.digest) is None  # nothing half-kept
    finally:
        await cache.aclose()


async def test_write_through_requests_are_on_disk_when_the_fill_returns(
    tmp_path: Path,
) -> None:
    """Write-behind batches disk writes; a request marked write_through waits for its own."""
    disk = DiskStore(tmp_path / "l2", linger_s=60.0)
    cache = ExactCache(
        memory=MemoryStore[CachedAnswer](1 << 20, sizeof=CachedAnswer.memory_size),
        lower=[disk],
        write_behind=True,
    )
    other = DiskStore(tmp_path / "l2")  # another worker process of the machine
    try:
        backend = Backend()
        behind = await prep(cache, "written behind")
        await cache.get_or_fill(behind, backend.fill_for("a"))
        assert await other.get(behind.key.digest) is None  # still lingering
        through = msgspec.structs.replace(await prep(cache, "written through"), write_through=True)
        await cache.get_or_fill(through, backend.fill_for("b"))
        assert await other.get(through.key.digest) is not None
    finally:
        await cache.aclose()
        await other.aclose()
    async with DiskStore(tmp_path / "l2") as reopened:
        assert await reopened.get(behind.key.digest) is not None  # flushed at close


async def test_a_reference_reads_the_stored_digest_for_its_own_scope_model_and_revision(
    cache: ExactCache, clock: SteppedClock, registry: CollectorRegistry
) -> None:
    """A semantic record's digest is read as the entry it names, whatever else went into
    that entry's key (a note, a content rule's version): no second key is built. Another
    tenant, model revision or an expired or purged entry reads as a miss."""
    backend = Backend()
    stored = await prep(cache, "Capital of France?", max_tokens=256, max_tokens_applied=256)
    await cache.get_or_fill(stored, backend.fill_for("France"))
    digest = stored.key.digest
    asking = await prep(cache, "capital of france ?", max_tokens=256, max_tokens_applied=256)
    assert asking.key.digest != digest

    res = await cache.lookup_ref(asking, digest)
    assert res.status is CacheStatus.HIT and content(res.entry).startswith("answer to France")
    assert metric(registry, "semcache_exact_hits_total", model=MODEL, tier="memory") == 1

    other_tenant = await prep(cache, "capital of france ?", tenant="globex")
    assert (await cache.lookup_ref(other_tenant, digest)).status is CacheStatus.MISS
    other_revision = await cache.prepare(
        route="chat", body=body(), model_id=MODEL, revision="rev-2", rule=RULE, tenant="acme"
    )
    assert (await cache.lookup_ref(other_revision, digest)).status is CacheStatus.MISS
    bypass = await prep(cache, "capital of france ?", control=CacheControl(bypass_read=True))
    assert (await cache.lookup_ref(bypass, digest)).status is CacheStatus.BYPASS
    young = await prep(cache, "capital of france ?", control=CacheControl(max_age_s=5))
    clock.now += 10
    assert (await cache.lookup_ref(young, digest)).status is CacheStatus.MISS
    assert (await cache.lookup_ref(asking, digest)).status is CacheStatus.HIT
    await cache.purge("model", MODEL)
    assert (await cache.lookup_ref(asking, digest)).status is CacheStatus.MISS
