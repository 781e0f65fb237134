"""The policy's ``[tiers]`` settings: where the exact and semantic caches keep their entries
(read once, when the caches open)."""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import NonNegFloat, NonNegInt, PosFloat, PosInt


class MemoryTier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """L1: in-process LRU bounded in bytes (per worker process)."""

    max_bytes: NonNegInt = 64 * 1024 * 1024
    """0 disables the memory tier."""


class DiskTier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """L2: ``diskcache`` directory shared by the workers of one machine."""

    enabled: bool = True
    dir: str = "cache/exact"
    """Relative paths are resolved against the gateway's data directory."""
    max_bytes: PosInt = 1024 * 1024 * 1024
    eviction: Literal["least-recently-stored", "least-recently-used", "least-frequently-used"] = (
        "least-recently-stored"
    )


class RedisTier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """L3: a Redis/Valkey server shared by several gateways. No URL → no L3."""

    url: str | None = None
    prefix: str = "semcache"
    timeout_s: PosFloat = 0.25
    """Socket connect/read timeout: a slow Redis costs at most this much per call."""
    retry_after_s: PosFloat = 0.5
    """First back-off after a failure; doubles up to ``max_retry_after_s``."""
    max_retry_after_s: PosFloat = 10.0
    epoch_recheck_s: NonNegFloat = 0.0
    """How old the local copy of the purge epochs may get before a read rechecks Redis.
    0 checks on every lookup (one small GET) so a purge is seen at once by every gateway;
    pub/sub pushes bumps in any case."""

    @property
    def enabled(self) -> bool:
        return bool(self.url)


class SemanticTier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the semantic index lives on disk: its durable records and its snapshots."""

    dir: str = "cache/semantic"
    """Relative paths are resolved against the gateway's data directory."""
    max_bytes: PosInt = 2 * 1024 * 1024 * 1024
    """Bound of the records directory (diskcache; the least recently stored go first)."""
    snapshot_interval_s: NonNegFloat = 300.0
    """Write the index snapshot this often when it changed (0: only at shutdown). Records
    are durable at once; the snapshot only makes a restart faster."""


class TierSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    memory: MemoryTier = msgspec.field(default_factory=MemoryTier)
    disk: DiskTier = msgspec.field(default_factory=DiskTier)
    redis: RedisTier = msgspec.field(default_factory=RedisTier)
    semantic: SemanticTier = msgspec.field(default_factory=SemanticTier)
