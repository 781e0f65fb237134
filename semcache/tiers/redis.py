"""L3: a Redis/Valkey server shared by several gateways, behind a circuit breaker.

When Redis is down or slow the gateway must keep serving from L1/L2 and the backends: every
call goes through :class:`RedisLink`, which turns connection errors and timeouts into a
default answer (a miss, a skipped write), logs the outage once, and stops trying for a short
back-off (doubling up to a bound). After the back-off a single call probes the server; on
success the link is closed again and the recovery is logged. redis-py reconnects its pool by
itself, so the probe is just the next ordinary call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Self, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from foundation.redis_client import UNREACHABLE_ERRORS, RedisClient, open_redis
from semcache.tiers.base import Store

log = logging.getLogger(__name__)

T = TypeVar("T")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (*UNREACHABLE_ERRORS, OSError, TimeoutError)


class CircuitBreaker:
    """Closed → open for a back-off after a failure → one probe → closed again on success."""

    def __init__(
        self,
        name: str,
        *,
        retry_after_s: float = 0.5,
        max_retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.base_s = retry_after_s
        self.max_s = max_retry_after_s
        self.clock = clock
        self._open_until = 0.0
        self._backoff = 0.0
        self._probing = False
        self.failures = 0
        """Outages seen (one per closed → open transition)."""

    @property
    def is_open(self) -> bool:
        return self._backoff > 0.0

    def allow(self) -> bool:
        """Whether a call may go to the server now."""
        if self._backoff == 0.0:
            return True
        if self._probing or self.clock() < self._open_until:
            return False
        self._probing = True
        return True

    def abandon(self) -> None:
        """A call ended without telling whether the server works (it was cancelled)."""
        self._probing = False

    def success(self) -> None:
        if self._backoff:
            log.warning("%s is reachable again", self.name)
        self._backoff = 0.0
        self._probing = False

    def failure(self, exc: BaseException) -> None:
        if self._backoff == 0.0:
            self.failures += 1
            log.warning(
                "%s unavailable (%s: %s); working without it, retrying in %.2fs",
                self.name,
                type(exc).__name__,
                exc,
                self.base_s,
            )
            self._backoff = self.base_s
        else:
            self._backoff = min(self._backoff * 2, self.max_s)
        self._probing = False
        self._open_until = self.clock() + self._backoff


class RedisLink:
    """One Redis client and its breaker, shared by the L3 store and the purge epochs."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "semcache",
        timeout_s: float = 0.25,
        retry_after_s: float = 0.5,
        max_retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.client: RedisClient = open_redis(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        self.breaker = CircuitBreaker(
            f"redis {url}",
            retry_after_s=retry_after_s,
            max_retry_after_s=max_retry_after_s,
            clock=clock,
        )

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis recently failed)."""
        return not self.breaker.is_open

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    async def call(
        self, op: Callable[[RedisClient], Awaitable[T]], default: T, *, limit_s: float | None = None
    ) -> T:
        """Run ``op`` unless the breaker is open; on an outage return ``default``, never raise.

        ``limit_s`` bounds the whole operation (default: four socket timeouts).
        """
        if not self.breaker.allow():
            return default
        try:
            async with asyncio.timeout(limit_s or self.timeout_s * 4):
                result = await op(self.client)
        except OUTAGE_ERRORS as exc:
            self.breaker.failure(exc)
            return default
        except RedisError as exc:  # a command error, not an outage
            self.breaker.success()
            log.error("redis command failed: %s", exc)
            return default
        except BaseException:  # cancelled: no verdict on the server, free the probe slot
            self.breaker.abandon()
            raise
        self.breaker.success()
        return result

    async def aclose(self) -> None:
        try:
            await self.client.aclose()
        except OUTAGE_ERRORS:
            pass


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


class RedisStore(Store[bytes]):
    """Byte store on Redis; keys are ``<prefix>:<namespace>/<key>``. Never raises on outage."""

    tier = "redis"

    def __init__(self, link: RedisLink, *, namespace: str = "exact") -> None:
        super().__init__(namespace)
        self.link = link

    def _rkey(self, key: str) -> str:
        return self.link.key(self._full(key))

    async def get(self, key: str) -> bytes | None:
        k = self._rkey(key)
        value = await self.link.call(lambda r: r.get(k), None)
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            return
        k = self._rkey(key)
        px = max(1, int(ttl_s * 1000)) if ttl_s is not None else None
        await self.link.call(lambda r: r.set(k, value, px=px), None)

    async def delete(self, key: str) -> None:
        k = self._rkey(key)
        await self.link.call(lambda r: r.delete(k), None)

    async def delete_many(self, keys: Iterable[str]) -> None:
        ks = [self._rkey(k) for k in keys]
        if ks:
            await self.link.call(lambda r: r.delete(*ks), None)

    async def clear(self) -> None:
        base = self.link.key(self.namespace) if self.namespace else self.link.prefix + ":"
        pattern = _glob_escape(base) + ("/*" if self.namespace else "*")

        async def _clear(r: RedisClient) -> None:
            if self.namespace:
                await r.delete(base)
            batch: list[bytes] = []
            async for k in r.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    await r.unlink(*batch)
                    batch.clear()
            if batch:
                await r.unlink(*batch)

        await self.link.call(_clear, None, limit_s=60.0)

    def with_namespace(self, namespace: str) -> Self:
        return type(self)(self.link, namespace=self._child(namespace))

    async def aclose(self) -> None:
        """The link is shared; its owner closes it."""
