"""Settings of the usage ledger (the gateway config's ``[ledger]`` table)."""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import NonNegFloat, NonNegInt, PosFloat


class LedgerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where usage is counted and how often the counts are written."""

    enabled: bool = True
    storage: Literal["auto", "sqlite", "redis"] = "auto"
    """``auto``: Redis when the cache policy configures ``[tiers.redis] url``, else SQLite."""
    flush_interval_s: PosFloat = 1.0
    """Counts are aggregated in memory and written this often: a ``kill -9`` loses at most
    this much usage; a normal stop (SIGTERM) writes everything."""
    replicas: NonNegInt = 0
    """On Redis: a flush counts as written only once this many replicas hold it (``WAIT``);
    until then it is kept and sent again (each flush is applied once, by its id), so a
    failover loses no usage. ``0``: written once the primary has it."""
    replica_timeout_s: PosFloat = 1.0
    """Longest wait for those replicas on one flush."""
    path: str | None = None
    """The SQLite file; default ``<data_dir>/usage.sqlite3``. Relative paths are resolved
    against the data directory."""
    spent_refresh_s: NonNegFloat = 1.0
    """How old a tenant's stored day/month totals (read for budgets) may get before they are
    read again; what this gateway adds is counted at once in any case."""
