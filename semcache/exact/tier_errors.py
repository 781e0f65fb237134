"""Failed tier operations: every one counted, the first of a run logged, and the recovery too.

A broken tier never fails a request: a failed read is a miss, a failed write is an answer
not stored there.
"""

from __future__ import annotations

import logging
from typing import Any

from semcache.metrics import CacheMetrics
from semcache.tiers import DiskStore, Store

log = logging.getLogger("semcache.exact")


class TierErrors:
    """Which (tier, operation) pairs are failing now, and the count of their failures."""

    def __init__(self, metrics: CacheMetrics | None = None) -> None:
        self.metrics = metrics
        self._failing: set[tuple[str, str]] = set()
        """(tier, operation) pairs failing now: logged once, until they work again."""

    def failed(self, store: Store[Any], op: str, exc: Exception, count: int = 1) -> None:
        """Count a failed tier operation (``count`` entries); log the first of a run only."""
        if (store.tier, op) not in self._failing:
            self._failing.add((store.tier, op))
            log.warning(
                "cache tier %s failed on %s: %s: %s; serving without it (every failure is "
                "counted in semcache_exact_tier_errors_total; logged again once it recovers)",
                store.tier,
                op,
                type(exc).__name__,
                exc,
            )
        if self.metrics:
            self.metrics.tier_errors.labels(store.tier, op).inc(count)

    def worked(self, store: Store[Any], op: str) -> None:
        """The operation succeeded: log the recovery when it was failing."""
        if self._failing and (store.tier, op) in self._failing:
            self._failing.discard((store.tier, op))
            log.warning("cache tier %s works again on %s", store.tier, op)

    def disk_wrote(self, store: DiskStore, count: int, exc: Exception | None) -> None:
        """A batch of the disk tier was written (``exc`` None) or lost."""
        if exc is None:
            self.worked(store, "set")
        else:
            self.failed(store, "set", exc, count)
