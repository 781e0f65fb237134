"""A tenant's daily and monthly budgets, in tokens or USD, against its spend in the usage ledger.

A request is refused once the spend reached the budget; a request already admitted (a stream
in flight) always ends normally. Days and months are UTC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Literal, Protocol

import msgspec

from server.limits.settings import LimitSettings

Period = Literal["day", "month"]


class Spend(Protocol):
    """What the ledger's ``spent`` returns: a tenant's tokens and USD in one period."""

    @property
    def tokens(self) -> int: ...

    @property
    def usd(self) -> float: ...

    @property
    def tokens_saved(self) -> int:
        """The part of ``tokens`` answered from the cache."""
        ...


SpentFn = Callable[[str, Period, float], Awaitable[Spend]]


class BudgetStatus(msgspec.Struct, kw_only=True):
    period: str
    tokens: int | None
    tokens_spent: int
    usd: float | None
    usd_spent: float


def budget_periods(settings: LimitSettings) -> list[tuple[Period, int | None, float | None]]:
    """Each period ``settings`` sets a budget for, with its tokens and USD (``None``: none)."""
    periods: tuple[tuple[Period, int | None, float | None], ...] = (
        ("day", settings.daily_tokens, settings.daily_usd),
        ("month", settings.monthly_tokens, settings.monthly_usd),
    )
    return [(p, tokens, usd) for p, tokens, usd in periods if tokens is not None or usd is not None]


def tokens_spent(spend: Spend, settings: LimitSettings) -> int:
    """The tokens a budget counts: cache hits' only when ``hits_spend_tokens``."""
    return spend.tokens if settings.hits_spend_tokens else spend.tokens - spend.tokens_saved


def budget_reached(
    spend: Spend, settings: LimitSettings, period: Period, tokens: int | None, usd: float | None
) -> str | None:
    """Which budget of ``period`` the spend reached, in words; ``None`` when neither."""
    adjective = "daily" if period == "day" else "monthly"
    used = tokens_spent(spend, settings)
    if tokens is not None and used >= tokens:
        return f"{adjective} budget of {tokens} tokens (spent {used})"
    if usd is not None and spend.usd >= usd:
        return f"{adjective} budget of ${usd:.2f} (spent ${spend.usd:.2f})"
    return None


def budget_status(
    spend: Spend, settings: LimitSettings, period: Period, tokens: int | None, usd: float | None
) -> BudgetStatus:
    """One budget and what the tenant spent of it."""
    return BudgetStatus(
        period=period,
        tokens=tokens,
        tokens_spent=tokens_spent(spend, settings),
        usd=usd,
        usd_spent=round(spend.usd, 6),
    )


def period_end(now: float, period: Period) -> float:
    """When the UTC day or month holding ``now`` ends."""
    day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return (day + timedelta(days=1)).timestamp()
    next_month = (day.replace(day=1) + timedelta(days=32)).replace(day=1)
    return next_month.timestamp()
