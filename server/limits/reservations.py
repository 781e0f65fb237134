"""Token budgets reserved before dispatch: a request takes its worst case, settles after.

A tenant's charge for a UTC day or month is one counter: seeded from the usage ledger the
first time the period is used, then moved only here. Admission reserves the request's worst
case (its token estimate: the prompt plus ``max_tokens``) atomically, and only while the
charge is below the budget; settling adds the difference to the real usage (a refund when
it used less, all of it when it failed). So a concurrent burst overspends by at most one
request: each reservation sees every one before it.

On Redis (the limits' shared storage) one Lua script checks and reserves, so several
gateways share one charge; in memory an ``asyncio.Lock`` guards the seed-check-reserve step.
A Redis outage fails open, as the rate windows do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from foundation.redis_client import RedisClient

RESERVE = """
local key = KEYS[1]
local seed, cost, budget, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
redis.call('SET', key, seed, 'NX', 'EX', ttl)
local charged = tonumber(redis.call('GET', key))
if charged >= budget then
  return {0, charged}
end
return {1, redis.call('INCRBY', key, cost)}
"""
"""KEYS[1]: the charge; ARGV: the seed (the ledger's spend), the cost, the budget, the TTL.
Answers ``{reserved (1/0), the charge}``."""

SETTLE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return false
"""

SeedFn = Callable[[], Awaitable[int]]


@dataclass(slots=True)
class Reservation:
    """Tokens one request holds on one period's charge until it settles."""

    key: str
    tokens: int
    settled: bool = False


class Reservations:
    """Tenants' budget charges in memory (one gateway)."""

    def __init__(self) -> None:
        self._charges: dict[str, int] = {}
        self._lock = asyncio.Lock()

    def charge(self, key: str) -> int | None:
        return self._charges.get(key)

    async def read(self, key: str) -> int | None:
        """The charge now (``None``: not started this period)."""
        return self._charges.get(key)

    async def reserve(
        self, key: str, cost: int, budget: int, seed: SeedFn, ttl_s: int
    ) -> tuple[bool, int]:
        """``(reserved, the charge after)``: ``cost`` taken while the charge is under
        ``budget``; the charge starts at ``await seed()`` (the ledger) the first time."""
        async with self._lock:
            charged = self._charges.get(key)
            if charged is None:
                if len(self._charges) > 10_000:
                    self._charges.clear()  # old periods; the ledger seeds them again
                charged = self._charges[key] = await seed()
            if charged >= budget:
                return False, charged
            self._charges[key] = charged + cost
            return True, charged + cost

    async def settle(self, key: str, delta: int) -> None:
        """Add ``delta`` (negative: a refund) to the charge."""
        if key in self._charges:
            self._charges[key] += delta


class RedisReservations(Reservations):
    """Tenants' budget charges in Redis, shared by every gateway on it."""

    def __init__(self, redis: RedisClient) -> None:
        """``redis`` belongs to the caller (the rate windows close it); each charge is one key,
        so the scripts run on a cluster too."""
        super().__init__()
        self.redis = redis
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)

    def charge(self, key: str) -> int | None:
        return None  # held in Redis: read it with ``read``

    async def read(self, key: str) -> int | None:
        value = await self.redis.get(key)
        return None if value is None else int(value)

    async def reserve(
        self, key: str, cost: int, budget: int, seed: SeedFn, ttl_s: int
    ) -> tuple[bool, int]:
        if not await self.redis.exists(key):
            seeded = await seed()  # the ledger's spend; SET NX keeps the first seed
        else:
            seeded = 0
        reserved, charged = await self._reserve(keys=[key], args=[seeded, cost, budget, ttl_s])
        return bool(reserved), int(charged)

    async def settle(self, key: str, delta: int) -> None:
        await self._settle(keys=[key], args=[delta])
