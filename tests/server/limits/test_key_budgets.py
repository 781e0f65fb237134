"""An API key's own budgets on the limiter's charges (memory storage, a clock the test
moves): its tokens and USD, beside its tenant's budgets, renewed with the UTC day."""

from __future__ import annotations

import pytest

from server.errors import ApiError
from server.limits.key_budgets import split_budgets
from server.limits.settings import LimitSettings
from tests.server.limits.test_limits import Ledger, clock, limiter
from tests.support.stepped_clock import SteppedClock

__all__ = ["clock"]  # the fixture


def test_split_keeps_rates_and_budgets_apart() -> None:
    both = LimitSettings(requests_per_minute=5, daily_tokens=10, monthly_usd=2.0)
    rates, own = split_budgets(both)
    assert rates == LimitSettings(requests_per_minute=5)
    assert own == LimitSettings(daily_tokens=10, monthly_usd=2.0)
    assert split_budgets(LimitSettings(daily_usd=1.0)) == (None, LimitSettings(daily_usd=1.0))
    assert split_budgets(LimitSettings(requests_per_minute=5)) == (
        LimitSettings(requests_per_minute=5),
        None,
    )


async def test_a_key_spends_its_own_tokens_and_usd(clock: SteppedClock) -> None:
    ledger = Ledger()
    lim = limiter(clock, ledger, daily_tokens=1000)
    own = LimitSettings(daily_tokens=100, daily_usd=0.5)
    first = await lim.admit("key:a", "acme", None, 30, own_budgets=own)
    await lim.settle(first, 40, 20, cache_hit=False, cost_usd=0.3)
    (day,) = (await lim.status("key:a", "acme", None, own)).key_budgets
    assert (day.tokens_spent, day.usd_spent) == (60, 0.3)
    second = await lim.admit("key:a", "acme", None, 10, own_budgets=own)
    await lim.settle(second, 5, 5, cache_hit=False, cost_usd=0.25)
    with pytest.raises(ApiError) as refused:
        await lim.admit("key:a", "acme", None, 10, own_budgets=own)
    assert refused.value.status == 429 and refused.value.code == "insufficient_quota"
    assert "API key's daily budget of $0.50 (spent $0.55)" in refused.value.message
    assert "2026-12-02T00:00:00Z" in refused.value.message
    # another key of the tenant has its own counters; the refused request reserved nothing
    other = await lim.admit("key:b", "acme", None, 10, own_budgets=own)
    await lim.settle(other, 1, 1, cache_hit=False)
    (day,) = (await lim.status("key:a", "acme", None, own)).key_budgets
    assert day.tokens_spent == 70
    clock.advance(86_400)  # a new UTC day: the key's budgets renew
    renewed = await lim.admit("key:a", "acme", None, 10, own_budgets=own)
    await lim.settle(renewed, 0, 0, cache_hit=False)


async def test_the_tenants_budget_still_holds_over_a_key(clock: SteppedClock) -> None:
    ledger = Ledger()
    ledger.tokens["day"] = 1000
    lim = limiter(clock, ledger, daily_tokens=1000)
    with pytest.raises(ApiError) as refused:
        await lim.admit("key:a", "acme", None, 1, own_budgets=LimitSettings(daily_tokens=100))
    assert "daily budget of 1000 tokens" in refused.value.message
    assert "API key" not in refused.value.message


async def test_a_refused_token_budget_reserves_nothing(clock: SteppedClock) -> None:
    lim = limiter(clock, Ledger())
    own = LimitSettings(daily_tokens=10)
    first = await lim.admit("key:a", "acme", None, 8, own_budgets=own)
    await lim.settle(first, 10, 0, cache_hit=False)
    for _ in range(3):
        with pytest.raises(ApiError):
            await lim.admit("key:a", "acme", None, 8, own_budgets=own)
    (day,) = (await lim.status("key:a", "acme", None, own)).key_budgets
    assert day.tokens_spent == 10
    hit = await lim.admit("key:b", "acme", None, 8, own_budgets=own)
    await lim.settle(hit, 50, 50, cache_hit=True)  # a hit spends no token budget by default
    (day,) = (await lim.status("key:b", "acme", None, own)).key_budgets
    assert day.tokens_spent == 0
