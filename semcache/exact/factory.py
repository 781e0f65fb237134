"""Opening the exact cache from the policy's tier settings: memory, disk, Redis, purge epochs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from semcache.entry import CachedAnswer
from semcache.exact.cache import ExactCache
from semcache.exact.purge import EpochBook, LocalEpochs, RedisEpochs
from semcache.metrics import CacheMetrics
from semcache.policy import TierSettings
from semcache.tiers import DiskStore, MemoryStore, RedisLink, RedisStore, Store


def _resolve_dir(path: str, data_dir: str | Path) -> Path:
    d = Path(path).expanduser()
    return d if d.is_absolute() else Path(data_dir).expanduser() / d


async def open_exact_cache(
    tiers: TierSettings,
    *,
    data_dir: str | Path,
    registry: CollectorRegistry | None = None,
    write_behind: bool = True,
    clock: Callable[[], float] | None = None,
) -> ExactCache:
    """Build the cache from the policy's tier settings and start it (pub/sub listener).

    Relative disk paths are resolved against ``data_dir``. Without a disk tier the purge
    epochs are kept in memory only. ``clock``: the entries' ages (default: the system's).
    """
    memory = (
        MemoryStore[CachedAnswer](tiers.memory.max_bytes, sizeof=CachedAnswer.memory_size)
        if tiers.memory.max_bytes > 0
        else None
    )
    lower: list[Store[bytes]] = []
    epoch_dir: Path | None = None
    if tiers.disk.enabled:
        d = _resolve_dir(tiers.disk.dir, data_dir)
        lower.append(DiskStore(d, max_bytes=tiers.disk.max_bytes, eviction=tiers.disk.eviction))
        epoch_dir = d / "epochs"
    local = await asyncio.to_thread(LocalEpochs, epoch_dir)
    book: EpochBook = local
    links: list[RedisLink] = []
    r = tiers.redis
    if r.url:
        link = RedisLink(
            r.url,
            prefix=r.prefix,
            timeout_s=r.timeout_s,
            retry_after_s=r.retry_after_s,
            max_retry_after_s=r.max_retry_after_s,
        )
        links.append(link)
        lower.append(RedisStore(link, namespace="exact"))
        book = RedisEpochs(link, local, recheck_s=r.epoch_recheck_s)
    cache = ExactCache(
        memory=memory,
        lower=lower,
        epochs=book,
        metrics=CacheMetrics(registry) if registry is not None else None,
        links=links,
        write_behind=write_behind,
        clock=clock or time.time,
    )
    await cache.start()
    return cache
