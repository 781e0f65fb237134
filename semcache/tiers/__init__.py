"""Cache storage tiers: L1 memory (LRU, bytes-bounded), L2 disk (diskcache), L3 Redis."""

from semcache.tiers.base import Store
from semcache.tiers.disk import DiskStore
from semcache.tiers.memory import MemoryStore
from semcache.tiers.redis import CircuitBreaker, RedisLink, RedisStore

__all__ = ["CircuitBreaker", "DiskStore", "MemoryStore", "RedisLink", "RedisStore", "Store"]
