"""Per-token rate limits and per-tenant budgets: admit a request, or refuse it with a 429.

Counting is done by the `limits` library (fixed one-minute windows, ``FixedWindowRateLimiter``)
on its in-process memory storage, or on Redis when the policy configures ``[tiers.redis]``:
then every gateway on that Redis counts into the same windows and N gateways enforce one
limit. A fixed window was chosen over the moving and sliding ones because its counter takes
any increment, negative included, through the storage's public ``incr``: that is how a token
estimate made at admission is reconciled with the ``usage`` the backend reported.

Concurrent requests are counted per gateway, in memory: a slot is held for the lifetime of
one request (a stream included), and a gateway that dies must not leave slots taken in a
shared store.

Budgets (daily/monthly tokens or USD) read the tenant's spend from the usage ledger; a
request is refused once the spend reached the budget, and a request already admitted (a
stream in flight) always ends normally.

Batch items (``background=True``) are counted by the ledger against the submitting tenant,
so they spend its budgets, but they take no capacity of the live windows and no concurrency
slot, and are never refused: a batch never makes a live request wait.

When Redis is unreachable the limits fail open: requests are admitted uncounted, the outage
is logged once (the circuit breaker of the L3 tier probes it again later), and
:attr:`TenantLimiter.unchecked` counts the requests admitted that way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Literal, Protocol, TypeVar, cast

import msgspec
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from redis.asyncio import ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from foundation.config_types import PosFloat, PosInt
from semcache.tiers.redis import OUTAGE_ERRORS, CircuitBreaker
from server.errors import ApiError

log = logging.getLogger("semcache.limits")

T = TypeVar("T")

_MINUTE = 60
_MAX_REMEMBERED = 10_000
_REQUESTS_HEADERS = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
_TOKENS_HEADERS = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)
"""Storage keys and window ends remembered at most (then forgotten at once, and read again)."""

_FAILURES: tuple[type[BaseException], ...] = (StorageError, *OUTAGE_ERRORS)

Period = Literal["day", "month"]


class LimitSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Limits of one token: the ``[limits]`` defaults, or a token entry's ``limits`` override.

    Every field left out (``None``) means no limit, or, in an override, the default's value.
    """

    requests_per_minute: PosInt | None = None
    tokens_per_minute: PosInt | None = None
    """Prompt (estimated at admission, reconciled with ``usage`` after) plus completion."""
    concurrent_requests: PosInt | None = None
    """Requests in flight at once, per gateway."""
    daily_tokens: PosInt | None = None
    monthly_tokens: PosInt | None = None
    daily_usd: PosFloat | None = None
    monthly_usd: PosFloat | None = None
    """Budgets of the token's tenant, read from the usage ledger; days and months are UTC.

    The USD budgets count what the backends' work cost: a cache hit costs nothing."""
    hits_spend_tokens: bool | None = None
    """Whether cache hits spend tokens per minute and the token budgets (default false: that
    is what a cache is for). A hit always counts as a request."""

    def merged(self, override: LimitSettings | None) -> LimitSettings:
        """These defaults with every field the override sets replaced by the override's."""
        if override is None:
            return self
        changes = {
            name: value
            for name in override.__struct_fields__
            if (value := getattr(override, name)) is not None
        }
        return msgspec.structs.replace(self, **changes) if changes else self

    @property
    def limited(self) -> bool:
        """Whether any limit or budget is set."""
        return any(getattr(self, name) is not None for name in _LIMIT_FIELDS)

    @property
    def budgets(self) -> bool:
        return any(
            v is not None
            for v in (self.daily_tokens, self.monthly_tokens, self.daily_usd, self.monthly_usd)
        )


_LIMIT_FIELDS = tuple(f for f in LimitSettings.__struct_fields__ if f != "hits_spend_tokens")


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


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's ``x-ratelimit-reset-*`` headers write it: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(slots=True)
class Window:
    """One rate window as admission left it: the limit, what remains, when it resets."""

    limit: int
    remaining: int
    reset_at: float
    """When the window ends, on the storage's clock (``time.time`` in production)."""
    storage_key: str


class BudgetStatus(msgspec.Struct, kw_only=True):
    period: str
    tokens: int | None
    tokens_spent: int
    usd: float | None
    usd_spent: float


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


@dataclass(slots=True, eq=False)
class Admission:
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


def _tokens_spent(spend: Spend, settings: LimitSettings) -> int:
    """The tokens a budget counts: cache hits' only when ``hits_spend_tokens``."""
    return spend.tokens if settings.hits_spend_tokens else spend.tokens - spend.tokens_saved


def _period_end(now: float, period: Period) -> float:
    """When the UTC day or month holding ``now`` ends."""
    day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return (day + timedelta(days=1)).timestamp()
    next_month = (day.replace(day=1) + timedelta(days=32)).replace(day=1)
    return next_month.timestamp()


def open_storage(
    uri: str, *, prefix: str = "semcache:limits", timeout_s: float = 0.25
) -> tuple[Storage, ConnectionPool | None]:
    """The `limits` storage for ``uri`` (``async+memory://`` or ``async+redis://host:port/db``)
    and the Redis connection pool it uses, which the caller closes.

    Redis gets short socket timeouts and no retries, so an outage costs one timeout, then the
    breaker keeps requests off it.
    """
    if not uri.startswith(("async+redis", "async+valkey")):
        return cast(Storage, storage_from_string(uri)), None
    pool = ConnectionPool.from_url(
        uri.removeprefix("async+"),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    options: dict[str, Any] = {"connection_pool": pool}
    storage = storage_from_string(
        uri, implementation="redispy", key_prefix=prefix, wrap_exceptions=True, **options
    )
    return cast(Storage, storage), pool


def build_limiter(
    defaults: LimitSettings,
    overrides: Iterable[LimitSettings | None],
    *,
    redis_url: str | None,
    redis_prefix: str,
    spent: SpentFn | None,
) -> TenantLimiter | None:
    """The app's limiter: on the policy's Redis when it has one (read at start), else in
    memory; ``None`` when neither the defaults nor any token set a limit."""
    limited = [s for s in (defaults, *overrides) if s is not None and s.limited]
    if not limited:
        return None
    uri = "async+" + redis_url if redis_url else "async+memory://"
    return TenantLimiter(defaults, storage_uri=uri, spent=spent, redis_prefix=redis_prefix)


class TenantLimiter:
    """Admits requests against their token's limits and their tenant's budgets."""

    def __init__(
        self,
        defaults: LimitSettings,
        *,
        storage_uri: str,
        spent: SpentFn | None,
        clock: Callable[[], float] = time.time,
        redis_prefix: str = "semcache",
        timeout_s: float = 0.25,
    ) -> None:
        """``clock`` must be the storage's clock (``time.time``): window resets are read on it."""
        self.defaults = defaults
        self.spent = spent
        self.clock = clock
        self.timeout_s = timeout_s
        self.storage, self._pool = open_storage(
            storage_uri, prefix=f"{redis_prefix}:limits", timeout_s=timeout_s
        )
        self.shared = not storage_uri.startswith("async+memory")
        self.windows = FixedWindowRateLimiter(self.storage)
        self.breaker = CircuitBreaker(f"rate-limit storage {storage_uri}", clock=clock)
        self._in_flight: dict[str, int] = {}
        self._items: dict[int, RateLimitItem] = {}
        self._merged: dict[LimitSettings | None, LimitSettings] = {}
        self._keys: dict[tuple[str, str, int], str] = {}
        self._resets: dict[str, float] = {}
        """When each window counted lately ends: its storage key's expiry, which the storage
        sets only when an ``incr`` answers its own amount (a window opening, or a count back
        from zero); otherwise it is read once per window."""
        self._no_ledger_logged = False
        self.unchecked = 0
        """Requests admitted without their rate windows counted (storage unreachable)."""

    async def admit(
        self,
        key: str,
        tenant: str,
        override: LimitSettings | None,
        estimated_tokens: int,
        *,
        background: bool = False,
    ) -> Admission:
        """Count one request of token ``key``; ApiError 429 (headers attached) when over."""
        settings = self.settings_of(override)
        admission = Admission(key, tenant, settings, estimated_tokens, background=background)
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
            await self._count(admission)
        except BaseException:
            self._release(admission)
            raise
        return admission

    async def settle(
        self, admission: Admission, prompt_tokens: int, completion_tokens: int, *, cache_hit: bool
    ) -> None:
        """Release the request's slot and reconcile its token estimate with its real usage."""
        if admission.settled:
            return
        admission.settled = True
        self._release(admission)
        window = admission.tokens
        if window is None:
            return
        spends = not cache_hit or bool(admission.settings.hits_spend_tokens)
        delta = (prompt_tokens + completion_tokens if spends else 0) - admission.tokens_counted
        if delta < 0 and self.clock() >= window.reset_at:
            return  # the estimate was counted in a window that has ended: nothing to give back
        if delta:
            counted = await self._storage(partial(self._add, window, delta), None)
            if counted is not None:
                admission.tokens_counted += delta

    def settings_of(self, override: LimitSettings | None) -> LimitSettings:
        """The defaults merged with a token's override (merged once per override)."""
        merged = self._merged.get(override)
        if merged is None:
            merged = self._merged[override] = self.defaults.merged(override)
        return merged

    def headers(self, admission: Admission) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers, for the windows this request's token has."""
        return [(k.decode(), v.decode()) for k, v in self.encoded_headers(admission)]

    def encoded_headers(self, admission: Admission) -> list[tuple[bytes, bytes]]:
        """:meth:`headers` as an ASGI message carries them."""
        out: list[tuple[bytes, bytes]] = []
        now = self.clock()
        for names, window in (
            (_REQUESTS_HEADERS, admission.requests),
            (_TOKENS_HEADERS, admission.tokens),
        ):
            if window is None:
                continue
            limit, remaining, reset = names
            out.append((limit, str(window.limit).encode()))
            out.append((remaining, str(max(0, window.remaining)).encode()))
            out.append((reset, format_reset(window.reset_at - now).encode()))
        return out

    async def aclose(self) -> None:
        if self._pool is not None:
            try:
                await self._pool.aclose()
            except OUTAGE_ERRORS:
                pass
        timer = getattr(self.storage, "timer", None)  # the memory storage's expiry task
        if isinstance(timer, asyncio.Task) and not timer.done():
            timer.cancel()

    async def status(self, key: str, tenant: str, override: LimitSettings | None) -> TokenStatus:
        """What token ``key`` may still do now, without counting anything (the dashboard)."""
        settings = self.settings_of(override)
        admission = Admission(key, tenant, settings, 0)
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
            periods: tuple[tuple[Period, int | None, float | None], ...] = (
                ("day", settings.daily_tokens, settings.daily_usd),
                ("month", settings.monthly_tokens, settings.monthly_usd),
            )
            for period, tokens, usd in periods:
                if tokens is None and usd is None:
                    continue
                spend = await self.spent(tenant, period, self.clock())
                used = (
                    spend.tokens
                    if settings.hits_spend_tokens
                    else spend.tokens - spend.tokens_saved
                )
                status.budgets.append(
                    BudgetStatus(
                        period=period,
                        tokens=tokens,
                        tokens_spent=used,
                        usd=usd,
                        usd_spent=round(spend.usd, 6),
                    )
                )
        return status

    # --- admission steps ---------------------------------------------------------------

    def _item(self, per_minute: int) -> RateLimitItem:
        item = self._items.get(per_minute)
        if item is None:
            item = self._items[per_minute] = RateLimitItemPerMinute(per_minute)
        return item

    def _window(self, kind: str, key: str, per_minute: int) -> Window:
        """A window of token ``key``, not yet read (its storage key names the limit too)."""
        storage_key = self._keys.get((kind, key, per_minute))
        if storage_key is None:
            if len(self._keys) >= _MAX_REMEMBERED:  # an open gateway: a token per bearer key
                self._keys.clear()
            storage_key = self._item(per_minute).key_for(kind, key)
            self._keys[kind, key, per_minute] = storage_key
        return Window(per_minute, per_minute, 0.0, storage_key)

    def _release(self, admission: Admission) -> None:
        if not admission.holds_slot:
            return
        admission.holds_slot = False
        left = self._in_flight.get(admission.key, 0) - 1
        if left > 0:
            self._in_flight[admission.key] = left
        else:
            self._in_flight.pop(admission.key, None)

    async def _storage(self, op: Callable[[], Awaitable[T]], default: T) -> T:
        """Run a storage operation; on an outage return ``default`` (fail open), never raise."""
        if not self.shared:  # in-process memory: nothing to time out or fail
            return await op()
        if not self.breaker.allow():
            return default
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                result = await op()
        except _FAILURES as exc:
            self.breaker.failure(exc)
            return default
        except BaseException:
            self.breaker.abandon()
            raise
        self.breaker.success()
        return result

    async def _add(self, window: Window, amount: int) -> int:
        """Add ``amount`` (negative: give back) to a window, never below zero."""
        count = await self.storage.incr(window.storage_key, _MINUTE, amount=amount)
        if count == amount:
            self._resets.pop(window.storage_key, None)  # the storage set a new expiry
        if count < 0:
            count = await self.storage.incr(window.storage_key, _MINUTE, amount=-count)
        return count

    async def _hit(self, window: Window, cost: int) -> bool:
        """Count ``cost`` into one window (the fixed-window strategy of `limits`: the storage's
        ``incr``, whose answer is the count, so one round trip tells what remains); a refused
        hit is taken back at once."""
        count = await self.storage.incr(window.storage_key, _MINUTE, amount=cost)
        # A refusal reads the expiry afresh: another gateway may have moved it.
        fresh = count == cost
        allowed = count <= window.limit
        if not allowed:
            count = await self._add(window, -cost)
            fresh = True
        window.remaining = window.limit - count
        window.reset_at = await self._reset_of(window.storage_key, fresh=fresh)
        return allowed

    async def _reset_of(self, storage_key: str, *, fresh: bool) -> float:
        """When the window at ``storage_key`` ends: read from the storage when ``fresh`` (its
        expiry may have been set just now) or not known, else remembered."""
        reset = self._resets.get(storage_key)
        if fresh or reset is None or reset <= self.clock():
            reset = await self.storage.get_expiry(storage_key)
            if len(self._resets) >= _MAX_REMEMBERED:
                self._resets.clear()
            self._resets[storage_key] = reset
        return reset

    async def _count(self, admission: Admission) -> None:
        settings = admission.settings
        checks: list[tuple[str, Window, int]] = []
        if settings.requests_per_minute is not None:
            window = self._window("requests", admission.key, settings.requests_per_minute)
            checks.append(("requests", window, 1))
        if settings.tokens_per_minute is not None:
            window = self._window("tokens", admission.key, settings.tokens_per_minute)
            checks.append(("tokens", window, max(1, admission.estimated_tokens)))
        if not checks:
            return

        async def count_all() -> list[bool]:
            if self.shared and len(checks) > 1:  # the windows' round trips in parallel
                return list(await asyncio.gather(*(self._hit(w, cost) for _, w, cost in checks)))
            return [await self._hit(window, cost) for _, window, cost in checks]

        results = await self._storage(count_all, None)
        if results is None:
            self.unchecked += 1
            return
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
                await self._storage(partial(self._add, window, -cost), None)
        kind, cost, window = max(refused, key=lambda r: r[2].reset_at)
        wait = max(1, math.ceil(window.reset_at - self.clock()))
        unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
        used = window.limit - window.remaining
        message = (
            f"Rate limit reached for {unit}: Limit {window.limit}, Used {used}, "
            f"Requested {cost}. Please try again in {format_reset(window.reset_at - self.clock())}."
        )
        if kind == "tokens" and cost > window.limit:
            message = (
                f"Request too large for tokens per min (TPM): Limit {window.limit}, "
                f"Requested about {cost} (prompt estimate plus max_tokens). Send a shorter "
                "request or a smaller max_tokens."
            )
        raise ApiError(
            429,
            message,
            code="rate_limit_exceeded",
            type=kind,
            retry_after_s=wait,
            headers=dict(self.headers(admission)),
        )

    async def _refuse_concurrency(self, admission: Admission) -> None:
        await self._peek(admission)
        limit = admission.settings.concurrent_requests
        raise ApiError(
            429,
            f"Too many concurrent requests: Limit {limit}. Please retry when one has finished.",
            code="rate_limit_exceeded",
            type="requests",
            retry_after_s=1,
            headers=dict(self.headers(admission)),
        )

    async def _peek(self, admission: Admission) -> None:
        """Fill the admission's windows without counting (for the headers of a refusal)."""
        settings = admission.settings
        for kind, per_minute in (
            ("requests", settings.requests_per_minute),
            ("tokens", settings.tokens_per_minute),
        ):
            if per_minute is None:
                continue
            window = self._window(kind, admission.key, per_minute)
            stats = await self._storage(
                partial(self.windows.get_window_stats, self._item(per_minute), kind, admission.key),
                None,
            )
            if stats is not None:
                window.remaining, window.reset_at = stats.remaining, stats.reset_time
                setattr(admission, kind, window)

    async def _check_budgets(self, admission: Admission) -> None:
        settings = admission.settings
        if self.spent is None:
            if not self._no_ledger_logged:
                log.warning("budgets are configured but no usage ledger is: budgets not enforced")
                self._no_ledger_logged = True
            return
        now = self.clock()
        budgets: Mapping[Period, tuple[int | None, float | None]] = {
            "day": (settings.daily_tokens, settings.daily_usd),
            "month": (settings.monthly_tokens, settings.monthly_usd),
        }
        for period, (tokens, usd) in budgets.items():
            if tokens is None and usd is None:
                continue
            try:
                spend = await self.spent(admission.tenant, period, now)
            except Exception:
                log.exception("cannot read the %s spend of a tenant: budget not enforced", period)
                continue
            reached: str | None = None
            adjective = "daily" if period == "day" else "monthly"
            used = _tokens_spent(spend, settings)
            if tokens is not None and used >= tokens:
                reached = f"{adjective} budget of {tokens} tokens (spent {used})"
            elif usd is not None and spend.usd >= usd:
                reached = f"{adjective} budget of ${usd:.2f} (spent ${spend.usd:.2f})"
            if reached is None:
                continue
            reset = _period_end(now, period)
            await self._peek(admission)
            when = datetime.fromtimestamp(reset, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            raise ApiError(
                429,
                f"You exceeded your current quota: the {reached} is reached. It renews at {when}.",
                code="insufficient_quota",
                type="insufficient_quota",
                retry_after_s=max(1, math.ceil(reset - now)),
                headers=dict(self.headers(admission)),
            )
