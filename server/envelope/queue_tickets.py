"""The ``[queue]`` section: each request's ticket for a full pool's fair queue.

``backends.fleet.fair_queue`` holds the mechanics (bands, start-time fair queueing); this module
says which ticket a request gets: its tenant, its weight and bounds from the config, its
band (live requests ``interactive``, batch items ``batch``, ``background`` when the tenant's
entry or the request's ``x-semcache-priority: background`` header asks for it).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import NonNegFloat, PosFloat, PosInt
from foundation.request import ANONYMOUS, Band, QueueTicket

PRIORITY_HEADER = "x-semcache-priority"


class TenantQueue(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One tenant's share of the queue; a field left out takes the ``[queue]`` default."""

    weight: PosFloat | None = None
    max_queued: PosInt | None = None
    max_wait_s: PosFloat | None = None
    band: Literal["interactive", "background"] | None = None
    """Where the tenant's live requests wait (default ``interactive``)."""


class QueueSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How requests wait for a full pool (``backends.fleet.fair_queue``)."""

    enabled: bool = True
    """Off: one first-come-first-served line per pool, as before the fair queue."""
    weight: PosFloat = 1.0
    max_queued_per_tenant: PosInt | None = None
    """Waiters of one tenant in one pool past which a new one gets a 429."""
    max_wait_s: PosFloat | None = None
    """The longest a request waits for a slot (the backend's ``queue_timeout_s`` too)."""
    share_window_s: NonNegFloat = 1.0
    """While two or more tenants (or bands) used a pool less than this long ago, each holds
    at most its weighted share of the pool's slots, so a returning tenant finds one free
    instead of waiting behind a flood; 0: a free slot goes to whoever asks."""
    tenants: dict[str, TenantQueue] = msgspec.field(default_factory=dict)


class Tickets:
    """The tickets of every tenant, built once from the settings."""

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self._tickets: dict[tuple[str, Band | None], QueueTicket] = {}

    def _build(self, tenant: str, band: Band | None) -> QueueTicket:
        s = self.settings
        entry = s.tenants.get(tenant, TenantQueue())
        return QueueTicket(
            tenant=tenant,
            band=band or entry.band or "interactive",
            weight=entry.weight or s.weight,
            max_queued=entry.max_queued or s.max_queued_per_tenant,
            max_wait_s=entry.max_wait_s or s.max_wait_s,
            share_window_s=s.share_window_s,
        )

    def ticket(
        self, tenant: str | None, *, batch: bool = False, priority: str | None = None
    ) -> QueueTicket | None:
        """The ticket of a request of ``tenant`` (None with the queue off)."""
        if not self.settings.enabled:
            return None
        band: Band | None = "batch" if batch else None
        if priority == "background":
            band = "background"
        key = (tenant or ANONYMOUS, band)
        found = self._tickets.get(key)
        if found is None:
            found = self._tickets[key] = self._build(*key)
        return found
