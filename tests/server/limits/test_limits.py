"""TenantLimiter on the memory storage, with a clock the test moves (no sleeping)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from types import SimpleNamespace

import msgspec
import orjson
import pytest

from server.config import ConfigError, parse_config
from server.errors import ApiError
from server.limits.headers import format_reset
from server.limits.limiter import TenantLimiter, estimate_tokens
from server.limits.settings import LimitSettings
from tests.support.stepped_clock import SteppedClock

START = datetime(2026, 12, 1, 17, 0, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock(START)


class Ledger:
    """Stands in for the usage ledger's ``spent``: totals the test sets."""

    def __init__(self) -> None:
        self.tokens = {"day": 0, "month": 0}
        self.usd = {"day": 0.0, "month": 0.0}
        self.saved = {"day": 0, "month": 0}
        self.asked: list[tuple[str, str, float]] = []

    async def spent(self, tenant: str, period: str, now: float) -> SimpleNamespace:
        self.asked.append((tenant, period, now))
        return SimpleNamespace(
            tokens=self.tokens[period], usd=self.usd[period], tokens_saved=self.saved[period]
        )


def limiter(clock: SteppedClock, ledger: Ledger | None = None, **defaults: object) -> TenantLimiter:
    return TenantLimiter(
        msgspec.convert(defaults, LimitSettings),
        storage_uri="async+memory://",
        spent=ledger.spent if ledger else None,
        clock=clock,
    )


def refusal(exc: pytest.ExceptionInfo[ApiError]) -> tuple[str | None, str, int | None, dict]:
    err = exc.value
    assert err.status == 429
    return err.code, err.type, err.retry_after_s, dict(err.headers or [])


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LimitSettings.__struct_fields__)
def test_every_limit_field_makes_a_token_limited(name: str) -> None:
    # ``limited`` names the fields one by one (it is read per request): none may be missed.
    value = True if name == "hits_spend_tokens" else 1
    settings = msgspec.convert({name: value}, LimitSettings)
    assert settings.limited is (name != "hits_spend_tokens")
    assert settings.estimates_tokens is (
        name in ("tokens_per_minute", "daily_tokens", "monthly_tokens")
    )
    assert settings.budgets is (name.startswith(("daily_", "monthly_")))


def test_override_replaces_only_what_it_sets() -> None:
    defaults = LimitSettings(requests_per_minute=60, tokens_per_minute=1000, daily_usd=5.0)
    merged = defaults.merged(LimitSettings(requests_per_minute=10, hits_spend_tokens=True))
    assert merged == LimitSettings(
        requests_per_minute=10, tokens_per_minute=1000, daily_usd=5.0, hits_spend_tokens=True
    )
    assert defaults.merged(None) is defaults
    on = LimitSettings(hits_spend_tokens=True)
    assert on.merged(LimitSettings(hits_spend_tokens=False)).hits_spend_tokens is False


def test_config_limits_section_and_its_errors() -> None:
    cfg = parse_config({"limits": {"requests_per_minute": 5, "daily_usd": 1.5}})
    assert cfg.limits == LimitSettings(requests_per_minute=5, daily_usd=1.5)
    assert parse_config({}).limits == LimitSettings()
    with pytest.raises(ConfigError, match=r"limits.requests_per_minute"):
        parse_config({"limits": {"requests_per_minute": 0}})
    with pytest.raises(ConfigError, match=r"unknown field `rpm`"):
        parse_config({"limits": {"rpm": 5}})


def test_estimate_counts_the_body_and_the_completion_asked_for() -> None:
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50})
    assert estimate_tokens(body) == len(body) // 4 + 50
    body = orjson.dumps({"input": "y" * 40, "max_output_tokens": 7})
    assert estimate_tokens(body) == len(body) // 4 + 7
    quoted = orjson.dumps({"prompt": 'say "max_tokens": 900', "max_completion_tokens": 3})
    assert estimate_tokens(quoted) == len(quoted) // 4 + 3  # not the one inside the text
    assert estimate_tokens(b"not json at all, but text") == len(b"not json at all, but text") // 4
    assert estimate_tokens(b"") == 1


def test_reset_durations_are_written_like_openai() -> None:
    assert format_reset(0.0194) == "20ms"
    assert format_reset(1.0) == "1s"
    assert format_reset(59.2) == "1m0s"
    assert format_reset(360) == "6m0s"
    assert format_reset(3661) == "1h1m1s"
    assert format_reset(-3) == "0ms"


# --- windows ------------------------------------------------------------------------------


async def test_requests_per_minute_refuses_then_renews(clock: SteppedClock) -> None:
    lim = limiter(clock, requests_per_minute=3)
    admitted = [await lim.admit("tok", "acme", None, 10) for _ in range(3)]
    assert [dict(lim.headers(a))["x-ratelimit-remaining-requests"] for a in admitted] == [
        "2",
        "1",
        "0",
    ]
    assert dict(lim.headers(admitted[0])) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "1m0s",
    }
    clock.advance(15)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 10)
    code, kind, retry, headers = refusal(exc)
    assert (code, kind, retry) == ("rate_limit_exceeded", "requests", 45)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "45s"
    assert "Limit 3, Used 3, Requested 1" in exc.value.message
    # Another token has its own window; refused requests did not use this one's.
    await lim.admit("other", "acme", None, 10)
    clock.advance(45)
    again = await lim.admit("tok", "acme", None, 10)
    assert dict(lim.headers(again))["x-ratelimit-remaining-requests"] == "2"
    await lim.aclose()


async def test_tokens_per_minute_reconciles_the_estimate_with_usage(clock: SteppedClock) -> None:
    lim = limiter(clock, tokens_per_minute=100)
    first = await lim.admit("tok", "acme", None, 80)
    assert dict(lim.headers(first))["x-ratelimit-remaining-tokens"] == "20"
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 30)
    assert refusal(exc)[:3] == ("rate_limit_exceeded", "tokens", 60)
    await lim.settle(first, prompt_tokens=6, completion_tokens=4, cache_hit=False)
    await lim.settle(first, prompt_tokens=6, completion_tokens=4, cache_hit=False)  # idempotent
    second = await lim.admit("tok", "acme", None, 30)  # 10 + 30 counted
    assert dict(lim.headers(second))["x-ratelimit-remaining-tokens"] == "60"
    # Used more than estimated: the window takes the difference even past the limit.
    await lim.settle(second, prompt_tokens=30, completion_tokens=70, cache_hit=False)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 1)
    assert refusal(exc)[3]["x-ratelimit-remaining-tokens"] == "0"
    clock.advance(60)
    await lim.admit("tok", "acme", None, 100)
    await lim.aclose()


async def test_a_request_larger_than_the_window_says_so(clock: SteppedClock) -> None:
    lim = limiter(clock, tokens_per_minute=100, requests_per_minute=10)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 500)
    assert "Request too large" in exc.value.message
    # The refused request took nothing from either window.
    ok = await lim.admit("tok", "acme", None, 100)
    headers = dict(lim.headers(ok))
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    await lim.aclose()


async def test_cache_hits_spend_no_tokens_unless_the_switch_says_so(clock: SteppedClock) -> None:
    lim = limiter(clock, tokens_per_minute=100)
    hit = await lim.admit("tok", "acme", None, 90)
    await lim.settle(hit, prompt_tokens=50, completion_tokens=40, cache_hit=True)
    after = await lim.admit("tok", "acme", None, 100)  # the hit gave its 90 back
    assert dict(lim.headers(after))["x-ratelimit-remaining-tokens"] == "0"
    clock.advance(60)
    spending = LimitSettings(hits_spend_tokens=True)
    hit = await lim.admit("tok", "acme", spending, 90)
    await lim.settle(hit, prompt_tokens=50, completion_tokens=40, cache_hit=True)
    with pytest.raises(ApiError):
        await lim.admit("tok", "acme", spending, 11)
    await lim.aclose()


async def test_a_refund_after_the_window_ended_is_dropped(clock: SteppedClock) -> None:
    lim = limiter(clock, tokens_per_minute=100)
    old = await lim.admit("tok", "acme", None, 90)
    clock.advance(61)
    fresh = await lim.admit("tok", "acme", None, 90)
    await lim.settle(old, prompt_tokens=1, completion_tokens=0, cache_hit=False)
    with pytest.raises(ApiError):  # the new window still holds the full 90
        await lim.admit("tok", "acme", None, 11)
    assert fresh.tokens_counted == 90
    await lim.aclose()


async def test_override_limits_apply_per_token(clock: SteppedClock) -> None:
    lim = limiter(clock, requests_per_minute=100)
    strict = LimitSettings(requests_per_minute=1)
    a = await lim.admit("strict", "acme", strict, 1)
    assert dict(lim.headers(a))["x-ratelimit-limit-requests"] == "1"
    with pytest.raises(ApiError):
        await lim.admit("strict", "acme", strict, 1)
    b = await lim.admit("loose", "acme", None, 1)
    assert dict(lim.headers(b))["x-ratelimit-limit-requests"] == "100"
    await lim.aclose()


async def test_no_limits_no_headers(clock: SteppedClock) -> None:
    lim = limiter(clock)
    a = await lim.admit("tok", "acme", None, 10_000)
    assert lim.headers(a) == []
    await lim.settle(a, 10, 10, cache_hit=False)
    only_rpm = limiter(clock, requests_per_minute=5)
    b = await only_rpm.admit("tok", "acme", None, 10)
    assert {name for name, _ in only_rpm.headers(b)} == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    await lim.aclose()
    await only_rpm.aclose()


# --- concurrency ---------------------------------------------------------------------------


async def test_concurrent_requests_hold_a_slot_until_settled(clock: SteppedClock) -> None:
    lim = limiter(clock, concurrent_requests=2, requests_per_minute=10)
    a = await lim.admit("tok", "acme", None, 1)
    await lim.admit("tok", "acme", None, 1)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 1)
    code, kind, retry, headers = refusal(exc)
    assert (code, kind, retry) == ("rate_limit_exceeded", "requests", 1)
    assert headers["x-ratelimit-remaining-requests"] == "8"  # peeked, not counted
    await lim.settle(a, 1, 1, cache_hit=False)
    await lim.settle(a, 1, 1, cache_hit=False)  # a second settle frees nothing more
    await lim.admit("tok", "acme", None, 1)
    with pytest.raises(ApiError):
        await lim.admit("tok", "acme", None, 1)
    await lim.aclose()


async def test_a_refused_request_gives_its_slot_back(clock: SteppedClock) -> None:
    lim = limiter(clock, concurrent_requests=1, requests_per_minute=1)
    a = await lim.admit("tok", "acme", None, 1)
    await lim.settle(a, 1, 1, cache_hit=False)
    with pytest.raises(ApiError):  # over RPM, after taking the slot
        await lim.admit("tok", "acme", None, 1)
    clock.advance(60)
    await lim.admit("tok", "acme", None, 1)  # the slot was released by the refusal
    await lim.aclose()


# --- budgets -------------------------------------------------------------------------------


async def test_daily_token_budget_refuses_until_midnight(clock: SteppedClock) -> None:
    ledger = Ledger()
    lim = limiter(clock, ledger, daily_tokens=1000, requests_per_minute=10)
    in_flight = await lim.admit("tok", "acme", None, 10)
    # read for the check, and once more to seed the day's charge (server/.../reservations.py)
    assert ledger.asked == [("acme", "day", START)] * 2
    ledger.tokens["day"] = 1000
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 10)
    code, kind, retry, headers = refusal(exc)
    assert (code, kind) == ("insufficient_quota", "insufficient_quota")
    assert retry == 7 * 3600  # 17:00 UTC → midnight
    assert "daily budget of 1000 tokens (spent 1000)" in exc.value.message
    assert headers["x-ratelimit-remaining-requests"] == "9"  # the refusal counted nothing
    await lim.settle(in_flight, 5, 5, cache_hit=False)  # what was admitted ends normally
    await lim.aclose()


async def test_token_budgets_leave_cache_hits_out_unless_the_switch_says_so(
    clock: SteppedClock,
) -> None:
    ledger = Ledger()
    ledger.tokens["day"], ledger.saved["day"] = 1500, 600  # 900 from the backends
    lim = limiter(clock, ledger, daily_tokens=1000)
    await lim.admit("tok", "acme", None, 10)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", LimitSettings(hits_spend_tokens=True), 10)
    assert "daily budget of 1000 tokens (spent 1500)" in exc.value.message
    ledger.tokens["day"] = 1600
    with pytest.raises(ApiError):
        await lim.admit("tok", "acme", None, 10)
    await lim.aclose()


async def test_monthly_usd_budget_and_override(clock: SteppedClock) -> None:
    ledger = Ledger()
    ledger.usd["month"] = 12.5
    lim = limiter(clock, ledger, monthly_usd=10.0)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 10)
    assert exc.value.retry_after_s == 7 * 3600 + 24 * 3600 * 30  # 1 Jan 2027 00:00 UTC
    assert "monthly budget of $10.00 (spent $12.50)" in exc.value.message
    await lim.admit("rich", "acme", LimitSettings(monthly_usd=20.0), 10)
    assert [period for _, period, _ in ledger.asked] == ["month", "month"]
    await lim.aclose()


async def test_budgets_without_a_ledger_are_logged_once(
    clock: SteppedClock, caplog: pytest.LogCaptureFixture
) -> None:
    lim = limiter(clock, None, daily_tokens=1)
    with caplog.at_level(logging.WARNING, logger="semcache.limits"):
        await lim.admit("tok", "acme", None, 1)
        await lim.admit("tok", "acme", None, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "budgets are configured but no usage ledger is: budgets not enforced"
    ]
    await lim.aclose()


# --- background ----------------------------------------------------------------------------


async def test_background_items_are_never_refused_and_take_no_live_capacity(
    clock: SteppedClock,
) -> None:
    ledger = Ledger()
    lim = limiter(
        clock,
        ledger,
        requests_per_minute=1,
        tokens_per_minute=10,
        concurrent_requests=1,
        daily_tokens=5,
    )
    items = [await lim.admit("tok", "acme", None, 1000, background=True) for _ in range(20)]
    assert all(lim.headers(item) == [] for item in items)
    assert ledger.asked == []
    live = await lim.admit("tok", "acme", None, 10)  # the batch left the windows free
    assert dict(lim.headers(live))["x-ratelimit-remaining-requests"] == "0"
    ledger.tokens["day"] = 5  # the batch's spend reached the budget: live requests stop...
    await lim.settle(live, 1, 1, cache_hit=False)
    with pytest.raises(ApiError) as exc:
        await lim.admit("tok", "acme", None, 1)
    assert exc.value.code == "insufficient_quota"
    await lim.admit("tok", "acme", None, 1000, background=True)  # ...batch items do not
    for item in items:
        await lim.settle(item, 500, 500, cache_hit=False)
    await lim.aclose()


async def test_each_windows_end_is_the_storages_even_when_the_storage_moves_it(
    clock: SteppedClock,
) -> None:
    # The limiter remembers a window's end; the memory storage (as Redis's script) sets a new
    # expiry whenever a count comes back from zero: a cache hit gives back its whole estimate.
    lim = limiter(clock, requests_per_minute=1000, tokens_per_minute=10_000)
    for _ in range(4):
        admission = await lim.admit("tok", "acme", None, 50)
        for window in (admission.requests, admission.tokens):
            assert window is not None
            assert lim.rates.local is not None
            assert window.reset_at == lim.rates.local.get(window.storage_key)[1]
        await lim.settle(admission, 0, 0, cache_hit=True)
        clock.advance(7)
    assert dict(lim.headers(admission))["x-ratelimit-reset-requests"] == "32s"  # 60 - 4 * 7
    assert dict(lim.headers(admission))["x-ratelimit-reset-tokens"] == "53s"  # reopened 7 s ago
    await lim.aclose()
