"""A store that cannot serve (down, partitioned, a cluster not settled) is an outage everywhere."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ClusterDownError, SlotNotCoveredError, TryAgainError

from foundation.redis_client import UNREACHABLE_ERRORS
from semcache.ledger import LedgerUnavailable
from semcache.ledger.redis import RedisStorage
from semcache.tiers.redis import OUTAGE_ERRORS, RedisLink

NOT_SETTLED = (
    ClusterDownError("The cluster is down"),
    TryAgainError("Multiple keys request during rehashing of slot"),
    SlotNotCoveredError("Slot 866 is not covered by the cluster"),
)
"""What a Redis Cluster answers for a while after its nodes lost sight of each other."""
each_error = pytest.mark.parametrize("error", NOT_SETTLED, ids=lambda e: type(e).__name__)


@each_error
def test_a_cluster_not_settled_is_an_outage(error: Exception) -> None:
    assert isinstance(error, UNREACHABLE_ERRORS)
    assert isinstance(error, OUTAGE_ERRORS)


class Failing:
    """A client (and its own pipeline) whose every command raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def pipeline(self, **_: Any) -> Failing:
        return self

    def smembers(self, *_: Any) -> None:
        return None

    async def execute(self) -> None:
        raise self.error

    async def get(self, *_: Any) -> None:
        raise self.error


@each_error
async def test_the_ledger_read_on_a_cluster_not_settled_is_unavailable(error: Exception) -> None:
    storage = RedisStorage("redis+cluster://127.0.0.1:1")
    storage.client = Failing(error)  # type: ignore[assignment]
    with pytest.raises(LedgerUnavailable, match=type(error).__name__):
        await storage.read("2026-12-01", "2026-12-01", [], None)


@each_error
async def test_the_cache_tier_on_a_cluster_not_settled_misses_and_opens_its_breaker(
    error: Exception,
) -> None:
    link = RedisLink("redis+cluster://127.0.0.1:1")
    link.client = Failing(error)  # type: ignore[assignment]
    assert await link.call(lambda c: c.get("k"), default=b"missed") == b"missed"
    assert not link.available
