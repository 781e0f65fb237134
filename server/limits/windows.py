"""Fixed one-minute rate windows on a `limits` storage: counted, given back, peeked.

The windows are those of the library's ``FixedWindowRateLimiter``, chosen over the moving and
sliding ones because a fixed window's counter takes any increment, negative included, through
the storage's public ``incr``: that is how a token estimate made at admission is reconciled
with the ``usage`` the backend reported.

A shared storage (Redis) fails open: an operation that meets an outage answers its default,
and the circuit breaker keeps the next ones off the storage until it probes it again. A gateway
without one counts the same windows in process (``local_windows``), synchronously: the
limiter calls the ``*_local`` methods then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter

from foundation.redis_client import RedisClient
from semcache.tiers.redis import OUTAGE_ERRORS, CircuitBreaker
from server.limits.local_windows import LocalWindows
from server.limits.storage import STORAGE_FAILURES, open_storage

T = TypeVar("T")

_MINUTE = 60
_MAX_REMEMBERED = 10_000
"""Storage keys and window ends remembered at most (then forgotten at once, and read again)."""


@dataclass(slots=True)
class Window:
    """One rate window as admission left it: the limit, what remains, when it resets."""

    limit: int
    remaining: int
    reset_at: float
    """When the window ends, on the storage's clock (``time.time`` in production)."""
    storage_key: str


class RateWindows:
    """Every token's rate windows on one storage: Redis shared by gateways, through `limits`,
    or this process's ``local`` windows."""

    def __init__(
        self,
        storage_uri: str,
        *,
        clock: Callable[[], float] = time.time,
        prefix: str = "semcache:limits",
        timeout_s: float = 0.25,
    ) -> None:
        """``clock`` must be the storage's clock (``time.time``): window resets are read on it."""
        self.clock = clock
        self.timeout_s = timeout_s
        self.shared = not storage_uri.startswith("async+memory")
        self.local = None if self.shared else LocalWindows(clock)
        """The windows of a gateway without a shared storage (``None`` on Redis)."""
        self._storage: Storage | None = None
        self._redis: RedisClient | None = None
        if self.shared:
            self._storage, self._redis = open_storage(
                storage_uri, prefix=prefix, timeout_s=timeout_s
            )
        self.breaker = CircuitBreaker(f"rate-limit storage {storage_uri}", clock=clock)
        self._items: dict[int, RateLimitItem] = {}
        self._keys: dict[tuple[str, str, int], str] = {}
        self._resets: dict[str, float] = {}
        """When each window counted lately ends: its storage key's expiry, which the storage
        sets only when an ``incr`` answers its own amount (a window opening, or a count back
        from zero); otherwise it is read once per window."""

    def window(self, kind: str, key: str, per_minute: int) -> Window:
        """A window of token ``key``, not yet read (its storage key names the limit too)."""
        storage_key = self._keys.get((kind, key, per_minute))
        if storage_key is None:
            if len(self._keys) >= _MAX_REMEMBERED:  # an open gateway: a token per bearer key
                self._keys.clear()
            storage_key = self._item(per_minute).key_for(kind, key)
            self._keys[kind, key, per_minute] = storage_key
        return Window(per_minute, per_minute, 0.0, storage_key)

    async def guarded(self, op: Callable[[], Awaitable[T]], default: T) -> T:
        """Run a storage operation; on an outage return ``default`` (fail open), never raise."""
        if not self.shared:  # in-process memory: nothing to time out or fail
            return await op()
        if not self.breaker.allow():
            return default
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                result = await op()
        except STORAGE_FAILURES as exc:
            self.breaker.failure(exc)
            return default
        except BaseException:
            self.breaker.abandon()
            raise
        self.breaker.success()
        return result

    async def add(self, window: Window, amount: int) -> int:
        """Add ``amount`` (negative: give back) to a window, never below zero."""
        count = await self.storage.incr(window.storage_key, _MINUTE, amount=amount)
        if count == amount:
            self._resets.pop(window.storage_key, None)  # the storage set a new expiry
        if count < 0:
            count = await self.storage.incr(window.storage_key, _MINUTE, amount=-count)
        return count

    async def hit(self, window: Window, cost: int) -> bool:
        """Count ``cost`` into one window (the fixed-window strategy of `limits`: the storage's
        ``incr``, whose answer is the count, so one round trip tells what remains); a refused
        hit is taken back at once."""
        count = await self.storage.incr(window.storage_key, _MINUTE, amount=cost)
        # A refusal reads the expiry afresh: another gateway may have moved it.
        fresh = count == cost
        allowed = count <= window.limit
        if not allowed:
            count = await self.add(window, -cost)
            fresh = True
        window.remaining = window.limit - count
        window.reset_at = await self._reset_of(window.storage_key, fresh=fresh)
        return allowed

    def hit_local(self, window: Window, cost: int) -> bool:
        """:meth:`hit` on the ``local`` windows."""
        assert self.local is not None
        count, window.reset_at = self.local.incr(window.storage_key, _MINUTE, cost)
        allowed = count <= window.limit
        if not allowed:
            count, window.reset_at = self.local.incr(window.storage_key, _MINUTE, -cost)
        window.remaining = window.limit - count
        return allowed

    def add_local(self, window: Window, amount: int) -> None:
        """:meth:`add` on the ``local`` windows."""
        assert self.local is not None
        count, _ = self.local.incr(window.storage_key, _MINUTE, amount)
        if count < 0:
            self.local.incr(window.storage_key, _MINUTE, -count)

    async def peek(self, kind: str, key: str, per_minute: int) -> Window | None:
        """A window of token ``key`` read without counting; ``None`` on an outage."""
        window = self.window(kind, key, per_minute)
        if self.local is not None:
            count, window.reset_at = self.local.get(window.storage_key)
            window.remaining = max(0, per_minute - count)
            return window
        strategy = FixedWindowRateLimiter(self.storage)
        stats = await self.guarded(
            partial(strategy.get_window_stats, self._item(per_minute), kind, key), None
        )
        if stats is None:
            return None
        window.remaining, window.reset_at = stats.remaining, stats.reset_time
        return window

    @property
    def storage(self) -> Storage:
        """The shared storage, through `limits` (only when ``shared``)."""
        assert self._storage is not None, "local windows have no storage"
        return self._storage

    @property
    def redis(self) -> RedisClient | None:
        """A client on the shared storage's Redis (None in memory)."""
        return self._redis

    async def aclose(self) -> None:
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except OUTAGE_ERRORS:
                pass

    def _item(self, per_minute: int) -> RateLimitItem:
        item = self._items.get(per_minute)
        if item is None:
            item = self._items[per_minute] = RateLimitItemPerMinute(per_minute)
        return item

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
