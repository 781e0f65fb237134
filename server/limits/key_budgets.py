"""An API key's own budgets: its tokens and USD per UTC day and month, on counters of its own.

A key's budgets lie inside its tenant's (the ``[limits]`` defaults, on the tenant's charge
and the usage ledger): a request is admitted only while both have room. The key's spend is
counted on the limiter's charges (``reservations``), not in a second ledger: the tokens as
the tenant's are (the worst case reserved at admission, settled to the real usage), the USD
in micro-dollars, added when the request settles. On Redis every gateway shares the
counters; in memory a restart starts them at 0 (the ledger does not split a tenant by key).
Batch items spend their tenant's budgets only.
"""

from __future__ import annotations

from functools import partial

import msgspec

from semcache.ledger.records import utc_day, utc_month
from server.limits.budgets import BudgetStatus, Period, budget_periods, period_end
from server.limits.reservations import Reservation, Reservations
from server.limits.settings import LimitSettings
from server.limits.windows import RateWindows

MICRO = 1_000_000
"""USD counters count micro-dollars (integers, for Redis INCRBY)."""

BUDGET_FIELDS = ("daily_tokens", "monthly_tokens", "daily_usd", "monthly_usd")


def split_budgets(
    limits: LimitSettings | None,
) -> tuple[LimitSettings | None, LimitSettings | None]:
    """A key's ``limits`` as (its rate limits, its own budgets); ``None`` for an empty part."""
    if limits is None or not limits.budgets:
        return limits, None
    rates = msgspec.structs.replace(limits, **dict.fromkeys(BUDGET_FIELDS))
    own = LimitSettings(
        **{name: getattr(limits, name) for name in BUDGET_FIELDS},
        hits_spend_tokens=limits.hits_spend_tokens,
    )
    return (rates if rates.limited or rates.hits_spend_tokens is not None else None), own


class KeyCharge(msgspec.Struct, kw_only=True):
    """What one request of a key holds on the key's USD counters until it settles."""

    usd_keys: list[str]


class KeyBudgets:
    """Checks, reserves and settles API keys' own budgets on the limiter's charges."""

    def __init__(self, reservations: Reservations, rates: RateWindows, prefix: str) -> None:
        """``rates``: whose ``guarded`` runs every storage call (fail open, one breaker)."""
        self.reservations = reservations
        self.rates = rates
        self.prefix = prefix

    def _keys(self, key: str, period: Period, now: float) -> tuple[str, str]:
        period_key = utc_day(now) if period == "day" else utc_month(now)
        return (
            f"{self.prefix}:keytokens:{key}:{period_key}",
            f"{self.prefix}:keyusd:{key}:{period_key}",
        )

    async def admit(
        self, key: str, own: LimitSettings, cost: int, now: float
    ) -> tuple[list[Reservation], KeyCharge, tuple[str, float] | None]:
        """Reserve ``cost`` tokens on each token budget of the key. The reservations, the USD
        counters to charge at the end, and (the budget in words, when it renews) when one is
        spent: then nothing stays reserved."""
        reserved: list[Reservation] = []
        usd_keys: list[str] = []
        spent: tuple[str, float] | None = None
        try:
            for period, tokens, usd in budget_periods(own):
                end = period_end(now, period)
                ttl = int(end - now) + 86_400
                tokens_key, usd_key = self._keys(key, period, now)
                adjective = "daily" if period == "day" else "monthly"
                if usd is not None:
                    answer = await self._reserve(usd_key, 0, round(usd * MICRO), ttl)
                    if answer is not None and not answer[0]:
                        used = answer[1] / MICRO
                        spent = (f"{adjective} budget of ${usd:.2f} (spent ${used:.2f})", end)
                        break
                    usd_keys.append(usd_key)
                if tokens is not None:
                    answer = await self._reserve(tokens_key, max(1, cost), tokens, ttl)
                    if answer is None:
                        continue  # the shared store is down: fail open
                    if not answer[0]:
                        spent = (
                            f"{adjective} budget of {tokens} tokens (charged {answer[1]})",
                            end,
                        )
                        break
                    reserved.append(Reservation(tokens_key, max(1, cost)))
        except BaseException:
            await self.settle(reserved, KeyCharge(usd_keys=[]), 0, 0.0)
            raise
        if spent is not None:
            await self.settle(reserved, KeyCharge(usd_keys=[]), 0, 0.0)
            return [], KeyCharge(usd_keys=[]), (f"API key's {spent[0]}", spent[1])
        return reserved, KeyCharge(usd_keys=usd_keys), None

    async def _reserve(self, key: str, cost: int, budget: int, ttl: int) -> tuple[bool, int] | None:
        async def zero() -> int:
            return 0

        op = partial(self.reservations.reserve, key, cost, budget, zero, ttl)
        return await self.rates.guarded(op, None)

    async def settle(
        self, reserved: list[Reservation], charge: KeyCharge, used: int, cost_usd: float
    ) -> None:
        """Move each token reservation to ``used``; add ``cost_usd`` to the USD counters."""
        for reservation in reserved:
            if reservation.settled:
                continue
            reservation.settled = True
            delta = used - reservation.tokens
            if delta:
                await self.rates.guarded(
                    partial(self.reservations.settle, reservation.key, delta), None
                )
        micro = round(cost_usd * MICRO)
        if micro > 0:
            for usd_key in charge.usd_keys:
                await self.rates.guarded(partial(self.reservations.settle, usd_key, micro), None)
        charge.usd_keys = []

    async def status(self, key: str, own: LimitSettings, now: float) -> list[BudgetStatus]:
        """The key's spend against each of its budgets in the current day and month."""
        out = []
        for period, tokens, usd in budget_periods(own):
            tokens_key, usd_key = self._keys(key, period, now)
            spent = await self.rates.guarded(partial(self.reservations.read, tokens_key), None)
            micro = await self.rates.guarded(partial(self.reservations.read, usd_key), None)
            out.append(
                BudgetStatus(
                    period=period,
                    tokens=tokens,
                    tokens_spent=spent or 0,
                    usd=usd,
                    usd_spent=round((micro or 0) / MICRO, 6),
                )
            )
        return out
