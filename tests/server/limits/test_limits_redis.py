"""TenantLimiter on a real Redis: two gateways share one limit; an outage fails open."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
import redis.asyncio

from server.errors import ApiError
from server.limits.limiter import TenantLimiter, build_limiter
from server.limits.settings import LimitSettings
from tests.semcache.conftest import RedisServer

pytestmark = pytest.mark.slow


def on_redis(url: str, prefix: str, **defaults: int) -> TenantLimiter:
    """A gateway's limiter on ``url``. The timeout is generous: past the shipped 0.25 s (a
    busy CI machine) a call fails open and admits a request uncounted, which is the outage
    test's subject, not this one's."""
    return TenantLimiter(
        LimitSettings(**defaults),  # type: ignore[arg-type]
        storage_uri="async+" + url,
        spent=None,
        redis_prefix=prefix,
        timeout_s=5.0,
    )


async def test_two_limiters_on_one_redis_enforce_one_limit(
    shared_redis_url: str, redis_prefix: str
) -> None:
    one = on_redis(shared_redis_url, redis_prefix, requests_per_minute=7, tokens_per_minute=1000)
    two = on_redis(shared_redis_url, redis_prefix, requests_per_minute=7, tokens_per_minute=1000)

    async def attempt(limiter: TenantLimiter) -> bool:
        try:
            await limiter.admit("tok", "acme", None, 10)
        except ApiError as exc:
            assert exc.code == "rate_limit_exceeded"
            return False
        return True

    # 20 requests, alternating between the gateways and 4 at a time: 7 pass in total.
    outcomes: list[bool] = []
    for _ in range(5):
        outcomes += await asyncio.gather(attempt(one), attempt(two), attempt(one), attempt(two))
    assert outcomes.count(True) == 7

    with pytest.raises(ApiError) as exc:
        await one.admit("tok", "acme", None, 10)
    headers = dict(exc.value.headers or [])
    assert headers["x-ratelimit-limit-requests"] == "7"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-remaining-tokens"] == "930"  # refused requests took nothing
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert 1 <= (exc.value.retry_after_s or 0) <= 60

    # Tokens reconciled on one gateway are seen by the other.
    other = await two.admit("tok2", "acme", None, 900)
    await two.settle(other, prompt_tokens=50, completion_tokens=50, cache_hit=False)
    seen = await one.admit("tok2", "acme", None, 900)
    assert dict(one.headers(seen))["x-ratelimit-remaining-tokens"] == "0"
    await one.aclose()
    await two.aclose()


async def test_redis_down_fails_open_and_logs_once(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory()
    limiter = on_redis(server.url, redis_prefix, requests_per_minute=2, tokens_per_minute=100)
    first = await limiter.admit("tok", "acme", None, 10)
    assert dict(limiter.headers(first))["x-ratelimit-remaining-requests"] == "1"
    server.stop()
    with caplog.at_level(logging.WARNING, logger="semcache.tiers.redis"):
        admitted = [await limiter.admit("tok", "acme", None, 10) for _ in range(5)]
    assert limiter.unchecked == 5
    assert all(limiter.headers(a) == [] for a in admitted)  # no figures it does not know
    for a in admitted:
        await limiter.settle(a, 5, 5, cache_hit=False)
    outages = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outages) == 1
    assert limiter.breaker.failures == 1
    await limiter.aclose()


async def test_the_policys_redis_timeout_decides_when_a_slow_redis_fails_open(
    redis_factory: Callable[[], RedisServer], redis_prefix: str
) -> None:
    """``[tiers.redis] timeout_s`` reaches the limits (``build_limiter``): a Redis that
    answers after 0.6 s fails a 0.25 s limiter open and is waited for by a 2 s one."""
    server = redis_factory()
    limits = LimitSettings(requests_per_minute=5)
    admitted = []
    for timeout_s in (0.25, 2.0):
        limiter = build_limiter(
            limits,
            [],
            redis_url=server.url,
            redis_prefix=f"{redis_prefix}-{timeout_s}",
            spent=None,
            redis_timeout_s=timeout_s,
        )
        assert limiter is not None
        await limiter.admit("tok", "acme", None, 10)  # connected and counted
        pause = redis.asyncio.Redis.from_url(server.url)
        await pause.execute_command("CLIENT", "PAUSE", "600", "ALL")
        await pause.aclose()
        seen = await limiter.admit("tok", "acme", None, 10)
        admitted.append((limiter.unchecked, dict(limiter.headers(seen))))
        await limiter.aclose()
        await asyncio.sleep(0.7)  # the pause is over
    (fast_unchecked, fast_headers), (slow_unchecked, slow_headers) = admitted
    assert fast_unchecked == 1 and fast_headers == {}  # failed open: nothing counted
    assert slow_unchecked == 0 and slow_headers["x-ratelimit-remaining-requests"] == "3"
