from __future__ import annotations

from tests.semcache.conftest import redis_prefix

__all__ = ["redis_prefix"]  # a Redis key prefix of its own per test
