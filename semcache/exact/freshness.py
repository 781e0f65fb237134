"""How fresh a stored answer is for one request: HIT, STALE (RFC 5861) or EXPIRED, and its age."""

from __future__ import annotations

from semcache.entry import CachedAnswer
from semcache.exact.request import CacheControl, CacheStatus


def freshness(entry: CachedAnswer, ctl: CacheControl, now: float) -> tuple[CacheStatus, float]:
    """The entry's status at ``now`` under the request's control, and its age in seconds.

    Fresh for its TTL, then stale for its ``swr_s``; a request ``max-age`` shortens the fresh
    time and takes no stale answer.
    """
    age = max(0.0, now - entry.created_at)
    fresh_for = float(entry.ttl_s)
    if ctl.max_age_s is not None:
        fresh_for = min(fresh_for, float(ctl.max_age_s))
        if age < fresh_for:
            return CacheStatus.HIT, age
        return CacheStatus.EXPIRED, age
    if age < fresh_for:
        return CacheStatus.HIT, age
    if age < entry.ttl_s + entry.swr_s:
        return CacheStatus.STALE, age
    return CacheStatus.EXPIRED, age
