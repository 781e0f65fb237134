"""The exact-match cache over the tiers: lookup, fill, coalescing, stale-while-revalidate.

``request`` holds what a lookup is about and returns, ``cache`` the cache itself,
``tier_stack`` the walk down L1 memory → L2 disk → L3 Redis (``tier_errors`` its failures),
``freshness`` HIT / STALE / EXPIRED, ``coalescing`` one fetch per missed key,
``revalidation`` the background refresh of stale answers, ``purge`` the purge epochs (in
every key's digest, so a purge reaches every tier and every gateway), and ``factory`` the
cache opened from the policy's tier settings.
"""

from semcache.exact.cache import ExactCache
from semcache.exact.coalescing import Flight
from semcache.exact.factory import open_exact_cache
from semcache.exact.request import CacheControl, CacheRequest, CacheResult, CacheStatus, Fill

__all__ = [
    "CacheControl",
    "CacheRequest",
    "CacheResult",
    "CacheStatus",
    "ExactCache",
    "Fill",
    "Flight",
    "open_exact_cache",
]
