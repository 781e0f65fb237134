"""Token budgets reserved before dispatch and settled after, in memory and on a real Redis:
a concurrent burst overspends by at most one request, across gateways too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from server.errors import ApiError
from server.limits.limiter import LimitAdmission, TenantLimiter
from server.limits.settings import LimitSettings

START = 1_796_144_400.0  # 2026-12-01 17:00 UTC


class Ledger:
    """The usage ledger's ``spent``, answering slowly enough that a burst overlaps."""

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens

    async def spent(self, tenant: str, period: str, now: float) -> SimpleNamespace:
        await asyncio.sleep(0)
        return SimpleNamespace(tokens=self.tokens, usd=0.0, tokens_saved=0)


def limiter(
    ledger: Ledger, storage_uri: str = "async+memory://", prefix: str = "t"
) -> TenantLimiter:
    return TenantLimiter(
        LimitSettings(daily_tokens=1000),
        storage_uri=storage_uri,
        spent=ledger.spent,
        clock=lambda: START,
        redis_prefix=prefix,
        # A burst of 50 opens its connections at once on a loaded machine: the default
        # quarter-second connect timeout would read as an outage, and an outage fails open.
        timeout_s=5.0,
    )


async def burst(limiters: list[TenantLimiter], n: int, cost: int) -> list[LimitAdmission]:
    async def one(i: int) -> LimitAdmission | None:
        try:
            return await limiters[i % len(limiters)].admit("tok", "acme", None, cost)
        except ApiError as err:
            assert err.status == 429 and err.code == "insufficient_quota"
            return None

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return [a for a in results if a is not None]


async def charge(lim: TenantLimiter) -> int | None:
    key = "t:budget:acme:2026-12-01"
    held = lim.reservations.charge(key)
    if held is not None:
        return held
    read = getattr(lim.reservations, "read", None)
    return None if read is None else await read(key)


async def test_a_burst_reserves_at_most_the_budget_in_memory() -> None:
    ledger = Ledger(tokens=100)  # 900 left: nine requests of 100 worst-case tokens
    lim = limiter(ledger)
    admitted = await burst([lim], 50, 100)
    assert len(admitted) == 9
    assert await charge(lim) == 1000
    # they settle to what they used: 40 each; the difference comes back
    for admission in admitted:
        await lim.settle(admission, 30, 10, cache_hit=False)
    assert await charge(lim) == 100 + 9 * 40
    more = await burst([lim], 50, 100)
    assert len(more) == 6  # 540 left: five fit, the sixth starts under the budget
    for admission in more:
        await lim.settle(admission, 0, 0, cache_hit=False)  # failed: all refunded
    assert await charge(lim) == 460
    await lim.aclose()


async def test_a_refusal_after_the_reservation_refunds_it() -> None:
    lim = TenantLimiter(
        LimitSettings(daily_tokens=1000, tokens_per_minute=150),
        storage_uri="async+memory://",
        spent=Ledger().spent,
        clock=lambda: START,
        redis_prefix="t",
    )
    first = await lim.admit("tok", "acme", None, 100)
    with pytest.raises(ApiError) as refused:
        await lim.admit("tok", "acme", None, 100)  # the minute's tokens refuse it
    assert refused.value.code != "insufficient_quota"
    assert await charge(lim) == 100  # only the admitted one holds its reservation
    await lim.settle(first, 50, 0, cache_hit=False)
    assert await charge(lim) == 50
    await lim.aclose()


@pytest.mark.slow
async def test_two_gateways_on_one_redis_share_one_charge(
    shared_redis_url: str, redis_prefix: str
) -> None:
    ledger = Ledger(tokens=0)
    uri = "async+" + shared_redis_url
    one, two = limiter(ledger, uri, redis_prefix), limiter(ledger, uri, redis_prefix)
    key = f"{redis_prefix}:budget:acme:2026-12-01"
    admitted = await burst([one, two], 50, 100)
    assert one.rates.breaker.failures == two.rates.breaker.failures == 0  # never failed open
    assert len(admitted) == 10  # one Lua script checks and reserves: no overspend
    assert await one.reservations.read(key) == 1000  # type: ignore[attr-defined]
    for admission, lim in zip(admitted, [one, two] * 5, strict=True):
        await lim.settle(admission, 60, 0, cache_hit=False)
    assert await two.reservations.read(key) == 600  # type: ignore[attr-defined]
    ttl = await one.reservations.redis.ttl(key)  # type: ignore[attr-defined]
    assert 7 * 3600 < ttl <= 7 * 3600 + 86_400
    await one.aclose()
    await two.aclose()
