"""TenantLimiter: admits a request against its token's limits and its tenant's budgets.

Requests and tokens per minute are counted in rate windows (``windows``). Concurrent requests
are counted per gateway, in memory: a slot is held for the lifetime of one request (a stream
included), and a gateway that dies must not leave slots taken in a shared store.

Batch items (``background=True``) are counted by the ledger against the submitting tenant,
so they spend its budgets, but they take no capacity of the live windows and no concurrency
slot, and are never refused: a batch never makes a live request wait.

When Redis is unreachable the limits fail open: requests are admitted uncounted, the outage
is logged once, and :attr:`TenantLimiter.unchecked` counts the requests admitted that way.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import msgspec
from limits.aio.storage import Storage

from semcache.ledger.records import utc_day, utc_month
from semcache.tiers.redis import CircuitBreaker
from server.limits.budgets import (
    BudgetStatus,
    Period,
    SpentFn,
    budget_periods,
    budget_reached,
    budget_status,
    period_end,
    tokens_spent,
)
from server.limits.headers import rate_headers
from server.limits.key_budgets import KeyBudgets, KeyCharge
from server.limits.refusals import quota_exceeded, rate_limited, too_many_concurrent
from server.limits.reservations import RedisReservations, Reservation, Reservations
from server.limits.settings import LimitSettings
from server.limits.windows import RateWindows, Window

log = logging.getLogger("semcache.limits")

_COMPLETION_LIMIT = re.compile(rb'"max_(?:completion_|output_)?tokens"\s*:\s*(\d+)')


def estimate_tokens(body: bytes) -> int:
    """A cheap upper-side estimate of a request's tokens, for tokens per minute at admission.

    Four bytes per token of the whole body (keys and punctuation make it err high, as it
    should before the real count is known) plus the completion it may ask for: the first
    ``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens`` it names. The body is
    searched, not parsed: the route parses it once, later.
    """
    estimate = len(body) // 4
    if (found := _COMPLETION_LIMIT.search(body)) is not None:
        estimate += int(found.group(1))
    return max(1, estimate)


class TokenStatus(msgspec.Struct, kw_only=True):
    """One token's limits and what remains of them (``None``: no such limit)."""

    token: str
    tenant: str
    in_flight: int
    concurrent_requests: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    requests_remaining: int | None
    tokens_remaining: int | None
    budgets: list[BudgetStatus] = msgspec.field(default_factory=list)
    key_budgets: list[BudgetStatus] = msgspec.field(default_factory=list)
    """An API key's own budgets and what the key spent of them."""


@dataclass(slots=True, eq=False)
class LimitAdmission:
    """What :meth:`TenantLimiter.admit` decided for one request; settled once at its end."""

    key: str
    tenant: str
    settings: LimitSettings
    estimated_tokens: int
    background: bool = False
    requests: Window | None = None
    tokens: Window | None = None
    tokens_counted: int = 0
    """Tokens this request added to its tokens-per-minute window so far."""
    holds_slot: bool = False
    settled: bool = False
    reserved: list[Reservation] = field(default_factory=list)
    """The token budgets' charges this request holds its worst case on until it settles."""
    key_reserved: list[Reservation] = field(default_factory=list)
    """The same on an API key's own token budgets (``key_budgets``)."""
    key_charge: KeyCharge | None = None
    """An API key's USD counters, charged the request's cost when it settles."""


def build_limiter(
    defaults: LimitSettings,
    overrides: Iterable[LimitSettings | None],
    *,
    redis_url: str | None,
    redis_prefix: str,
    spent: SpentFn | None,
    calendar: Callable[[], float] = time.time,
    overrides_later: bool = False,
    redis_timeout_s: float = 0.25,
) -> TenantLimiter | None:
    """The app's limiter: on the policy's Redis when it has one (read at start, with its
    ``timeout_s``), else in memory; ``None`` when neither the defaults nor any token set a
    limit and none can come later (``overrides_later``: API keys, made while serving, may
    have limits)."""
    limited = [s for s in (defaults, *overrides) if s is not None and s.limited]
    if not limited and not overrides_later:
        return None
    uri = "async+" + redis_url if redis_url else "async+memory://"
    return TenantLimiter(
        defaults,
        storage_uri=uri,
        spent=spent,
        redis_prefix=redis_prefix,
        calendar=calendar,
        timeout_s=redis_timeout_s,
    )


class TenantLimiter:
    """Admits requests against their token's limits and their tenant's budgets."""

    def __init__(
        self,
        defaults: LimitSettings,
        *,
        storage_uri: str,
        spent: SpentFn | None,
        clock: Callable[[], float] = time.time,
        calendar: Callable[[], float] | None = None,
        redis_prefix: str = "semcache",
        timeout_s: float = 0.25,
    ) -> None:
        """``clock`` must be the storage's clock (``time.time``): window resets are read on it.
        ``calendar`` says which UTC day and month the budgets spend (the ledger's clock;
        default ``clock``)."""
        self.defaults = defaults
        self.spent = spent
        self.clock = clock
        self.calendar = calendar or clock
        self.rates = RateWindows(
            storage_uri, clock=clock, prefix=f"{redis_prefix}:limits", timeout_s=timeout_s
        )
        self.reservations = (
            RedisReservations(self.rates.redis) if self.rates.redis is not None else Reservations()
        )
        self._budget_prefix = f"{redis_prefix}:budget"
        self.key_budgets = KeyBudgets(self.reservations, self.rates, redis_prefix)
        self._in_flight: dict[str, int] = {}
        self._merged: dict[LimitSettings | None, LimitSettings] = {}
        self._no_ledger_logged = False
        self.unchecked = 0
        """Requests admitted without their rate windows counted (storage unreachable)."""

    @property
    def storage(self) -> Storage:
        """The `limits` storage the rate windows are counted on."""
        return self.rates.storage

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker of a shared storage."""
        return self.rates.breaker

    async def admit(
        self,
        key: str,
        tenant: str,
        override: LimitSettings | None,
        estimated_tokens: int,
        *,
        background: bool = False,
        own_budgets: LimitSettings | None = None,
    ) -> LimitAdmission:
        """Count one request of token ``key``; ApiError 429 (headers attached) when over.

        ``own_budgets``: an API key's budgets, spent by that key alone (``key_budgets``),
        checked besides its tenant's."""
        settings = self.settings_of(override)
        admission = LimitAdmission(key, tenant, settings, estimated_tokens, background=background)
        if background:
            return admission
        if settings.concurrent_requests is not None:
            if self._in_flight.get(key, 0) >= settings.concurrent_requests:
                await self._refuse_concurrency(admission)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            admission.holds_slot = True
        try:
            if settings.budgets:
                await self._check_budgets(admission)
                if settings.daily_tokens is not None or settings.monthly_tokens is not None:
                    await self._reserve_budgets(admission)
            if own_budgets is not None and own_budgets.budgets:
                await self._reserve_key_budgets(admission, own_budgets)
            await self._count(admission)
        except BaseException:
            self._release(admission)
            await self._settle_budgets(admission, 0)
            raise
        return admission

    async def settle(
        self,
        admission: LimitAdmission,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cache_hit: bool,
        cost_usd: float = 0.0,
    ) -> None:
        """Release the request's slot and reconcile its token estimate with its real usage;
        ``cost_usd``: what the backends' work cost (an API key's USD budgets count it)."""
        if admission.settled:
            return
        admission.settled = True
        self._release(admission)
        spends = not cache_hit or bool(admission.settings.hits_spend_tokens)
        used = prompt_tokens + completion_tokens if spends else 0
        await self._settle_budgets(admission, used, cost_usd)
        window = admission.tokens
        if window is None:
            return
        delta = used - admission.tokens_counted
        if delta < 0 and self.clock() >= window.reset_at:
            return  # the estimate was counted in a window that has ended: nothing to give back
        if delta and await self._add(window, delta):
            admission.tokens_counted += delta

    def settings_of(self, override: LimitSettings | None) -> LimitSettings:
        """The defaults merged with a token's override (merged once per override)."""
        merged = self._merged.get(override)
        if merged is None:
            merged = self._merged[override] = self.defaults.merged(override)
        return merged

    def headers(self, admission: LimitAdmission) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers, for the windows this request's token has."""
        return [(k.decode(), v.decode()) for k, v in self.encoded_headers(admission)]

    def encoded_headers(self, admission: LimitAdmission) -> list[tuple[bytes, bytes]]:
        """:meth:`headers` as an ASGI message carries them."""
        return rate_headers(admission.requests, admission.tokens, self.clock())

    async def aclose(self) -> None:
        await self.rates.aclose()

    async def status(
        self,
        key: str,
        tenant: str,
        override: LimitSettings | None,
        own_budgets: LimitSettings | None = None,
    ) -> TokenStatus:
        """What token ``key`` may still do now, without counting anything (the dashboard)."""
        settings = self.settings_of(override)
        admission = LimitAdmission(key, tenant, settings, 0)
        await self._peek(admission)
        status = TokenStatus(
            token=key,
            tenant=tenant,
            in_flight=self._in_flight.get(key, 0),
            concurrent_requests=settings.concurrent_requests,
            requests_per_minute=settings.requests_per_minute,
            tokens_per_minute=settings.tokens_per_minute,
            requests_remaining=admission.requests.remaining if admission.requests else None,
            tokens_remaining=admission.tokens.remaining if admission.tokens else None,
        )
        if settings.budgets and self.spent is not None:
            for period, tokens, usd in budget_periods(settings):
                spend = await self.spent(tenant, period, self.calendar())
                status.budgets.append(budget_status(spend, settings, period, tokens, usd))
        if own_budgets is not None and own_budgets.budgets:
            status.key_budgets = await self.key_budgets.status(key, own_budgets, self.calendar())
        return status

    # --- admission steps ---------------------------------------------------------------

    def _release(self, admission: LimitAdmission) -> None:
        if not admission.holds_slot:
            return
        admission.holds_slot = False
        left = self._in_flight.get(admission.key, 0) - 1
        if left > 0:
            self._in_flight[admission.key] = left
        else:
            self._in_flight.pop(admission.key, None)

    async def _count(self, admission: LimitAdmission) -> None:
        settings = admission.settings
        rates = self.rates
        checks: list[tuple[str, Window, int]] = []
        if settings.requests_per_minute is not None:
            window = rates.window("requests", admission.key, settings.requests_per_minute)
            checks.append(("requests", window, 1))
        if settings.tokens_per_minute is not None:
            window = rates.window("tokens", admission.key, settings.tokens_per_minute)
            checks.append(("tokens", window, max(1, admission.estimated_tokens)))
        if not checks:
            return

        if rates.local is not None:
            results = [rates.hit_local(window, cost) for _, window, cost in checks]
        else:

            async def count_all() -> list[bool]:
                if len(checks) > 1:  # the windows' round trips in parallel
                    hits = (rates.hit(w, cost) for _, w, cost in checks)
                    return list(await asyncio.gather(*hits))
                return [await rates.hit(window, cost) for _, window, cost in checks]

            shared = await rates.guarded(count_all, None)
            if shared is None:
                self.unchecked += 1
                return
            results = shared
        refused: list[tuple[str, int, Window]] = []
        for (kind, window, cost), allowed in zip(checks, results, strict=True):
            setattr(admission, kind, window)
            if not allowed:
                refused.append((kind, cost, window))
        if not refused:
            if admission.tokens is not None:
                admission.tokens_counted = max(1, admission.estimated_tokens)
            return
        # Take back what the accepted windows counted for this refused request.
        for (_, window, cost), allowed in zip(checks, results, strict=True):
            if allowed:
                window.remaining += cost
                await self._add(window, -cost)
        kind, cost, window = max(refused, key=lambda r: r[2].reset_at)
        raise rate_limited(kind, cost, window, self.clock, dict(self.headers(admission)))

    async def _add(self, window: Window, amount: int) -> bool:
        """Add ``amount`` to ``window`` (negative: give back); False when the shared storage
        was unreachable (nothing counted)."""
        rates = self.rates
        if rates.local is not None:
            rates.add_local(window, amount)
            return True
        return await rates.guarded(partial(rates.add, window, amount), None) is not None

    async def _refuse_concurrency(self, admission: LimitAdmission) -> None:
        await self._peek(admission)
        limit = admission.settings.concurrent_requests
        raise too_many_concurrent(limit, dict(self.headers(admission)))

    async def _peek(self, admission: LimitAdmission) -> None:
        """Fill the admission's windows without counting (for the headers of a refusal)."""
        settings = admission.settings
        for kind, per_minute in (
            ("requests", settings.requests_per_minute),
            ("tokens", settings.tokens_per_minute),
        ):
            if per_minute is None:
                continue
            window = await self.rates.peek(kind, admission.key, per_minute)
            if window is not None:
                setattr(admission, kind, window)

    async def _reserve_budgets(self, admission: LimitAdmission) -> None:
        """Reserve the request's worst case on each token budget's charge (see
        ``reservations``); 429 when a charge already reached its budget."""
        settings = admission.settings
        spent = self.spent
        if spent is None:
            return
        now = self.calendar()
        cost = max(1, admission.estimated_tokens)
        for period, tokens, _ in budget_periods(settings):
            if tokens is None:
                continue
            period_key = utc_day(now) if period == "day" else utc_month(now)
            key = f"{self._budget_prefix}:{admission.tenant}:{period_key}"
            end = period_end(now, period)

            async def seed(period: Period = period) -> int:
                return tokens_spent(await spent(admission.tenant, period, now), settings)

            answer = await self.rates.guarded(
                partial(
                    self.reservations.reserve, key, cost, tokens, seed, int(end - now) + 86_400
                ),
                None,
            )
            if answer is None:
                continue  # the shared store is down: fail open
            reserved, charged = answer
            if not reserved:
                adjective = "daily" if period == "day" else "monthly"
                reached = f"{adjective} budget of {tokens} tokens (charged {charged})"
                await self._peek(admission)
                raise quota_exceeded(reached, end, now, dict(self.headers(admission)))
            admission.reserved.append(Reservation(key, cost))

    async def _reserve_key_budgets(self, admission: LimitAdmission, own: LimitSettings) -> None:
        """Reserve on an API key's own budgets; 429 when one is spent."""
        now = self.calendar()
        reserved, charge, spent = await self.key_budgets.admit(
            admission.key, own, admission.estimated_tokens, now
        )
        admission.key_reserved, admission.key_charge = reserved, charge
        if spent is not None:
            await self._peek(admission)
            raise quota_exceeded(spent[0], spent[1], now, dict(self.headers(admission)))

    async def _settle_budgets(
        self, admission: LimitAdmission, used: int, cost_usd: float = 0.0
    ) -> None:
        """Move each reservation to what the request used (all back when it used nothing)."""
        if admission.key_charge is not None:
            await self.key_budgets.settle(
                admission.key_reserved, admission.key_charge, used, cost_usd
            )
        for reservation in admission.reserved:
            if reservation.settled:
                continue
            reservation.settled = True
            delta = used - reservation.tokens
            if delta:
                await self.rates.guarded(
                    partial(self.reservations.settle, reservation.key, delta), None
                )

    async def _check_budgets(self, admission: LimitAdmission) -> None:
        settings = admission.settings
        if self.spent is None:
            if not self._no_ledger_logged:
                log.warning("budgets are configured but no usage ledger is: budgets not enforced")
                self._no_ledger_logged = True
            return
        now = self.calendar()
        for period, tokens, usd in budget_periods(settings):
            try:
                spend = await self.spent(admission.tenant, period, now)
            except Exception:
                log.exception("cannot read the %s spend of a tenant: budget not enforced", period)
                continue
            reached = budget_reached(spend, settings, period, tokens, usd)
            if reached is None:
                continue
            reset = period_end(now, period)
            await self._peek(admission)
            raise quota_exceeded(reached, reset, now, dict(self.headers(admission)))
