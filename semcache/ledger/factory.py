"""Build the ledger a gateway's settings ask for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from semcache.ledger.base import BufferedLedger, NullLedger, Storage, UsageLedger
from semcache.ledger.redis import RedisStorage
from semcache.ledger.settings import LedgerSettings
from semcache.ledger.sqlite import SqliteStorage

DEFAULT_FILE = "usage.sqlite3"


def open_ledger(
    settings: LedgerSettings,
    *,
    data_dir: Path,
    redis_url: str | None,
    redis_prefix: str,
    clock: Callable[[], float],
) -> UsageLedger:
    """The ledger of one app (not started: the app's lifespan calls ``start``).

    ``redis_url`` is the policy's ``[tiers.redis] url``: with ``storage = "auto"`` a Redis URL
    means Redis counters, none means SQLite. ``storage = "redis"`` without a URL is an error.
    """
    if not settings.enabled:
        return NullLedger()
    storage: Storage
    if settings.storage == "redis" or (settings.storage == "auto" and redis_url):
        if not redis_url:
            raise ValueError(
                'ledger.storage = "redis" needs a Redis: set the policy\'s [tiers.redis] url'
            )
        storage = RedisStorage(
            redis_url,
            prefix=redis_prefix,
            replicas=settings.replicas,
            replica_timeout_s=settings.replica_timeout_s,
        )
    else:
        path = Path(settings.path).expanduser() if settings.path else Path(DEFAULT_FILE)
        storage = SqliteStorage(data_dir / path)  # an absolute path replaces data_dir
    return BufferedLedger(
        storage,
        flush_interval_s=settings.flush_interval_s,
        spent_refresh_s=settings.spent_refresh_s,
        clock=clock,
    )
