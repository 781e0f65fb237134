"""The durable work queue behind asynchronous batches: what every queue backend implements.

A *job* is one submitted batch: an id, the tenant that owns it, the model it runs on and its
items (opaque bytes, in order). Workers *claim* items under a lease, keep the lease alive
while they work (``extend``), and *complete* each item with an opaque result. Completing is
idempotent: the first result stored for ``(job, index)`` wins, so an item that ran twice
(its worker died after answering but before the lease was released, or a lease expired)
still has exactly one result. A lease that is not extended expires, and the item goes back
to the queue for another worker: no item is lost when a worker is killed.

The queue knows nothing of HTTP, models or backends; the server gives meaning to the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec

JobStatus = Literal["queued", "running", "done"]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]


class QueueSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the batch queue lives and how long its leases and results last."""

    kind: Literal["disk", "redis"] = "disk"
    """``disk``: SQLite on local disk (one machine); ``redis``: Redis Streams (several gateways)."""
    path: str | None = None
    """SQLite file of the disk queue; default ``<data_dir>/queue/batch.sqlite3``."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: Annotated[str, msgspec.Meta(min_length=1)] = "semcache:batch"
    """Key prefix of the Redis queue: gateways sharing one prefix share one queue."""
    lease_s: PosFloat = 30.0
    """A claimed item returns to the queue when its worker has not renewed it for this long."""
    results_ttl_s: PosFloat = 86400.0
    """A finished batch (and its results) is removed this long after its last item completed."""
    max_age_s: PosFloat = 7 * 86400.0
    """An unfinished batch is dropped after this long (a safety net against leaks)."""


class WorkItem(msgspec.Struct, frozen=True, kw_only=True):
    """One claimed item; ``receipt`` identifies this claim to the backend that issued it."""

    job_id: str
    index: int
    tenant: str
    model: str
    payload: bytes
    attempts: int
    """How many times the item has been claimed, this claim included."""
    receipt: str


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    model: str
    total: int
    completed: int
    started: bool
    """True once any worker has claimed one of its items."""
    created_at: float
    finished_at: float | None = None

    @property
    def status(self) -> JobStatus:
        if self.completed >= self.total:
            return "done"
        return "running" if self.started or self.completed else "queued"


class ItemResult(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    body: bytes


class BatchQueue(Protocol):
    """A durable queue of batch items with leases and exactly-once results."""

    async def submit(self, job_id: str, tenant: str, model: str, payloads: Sequence[bytes]) -> None:
        """Store a job and all its items atomically (all or nothing)."""
        ...

    async def claim(self, consumer: str, limit: int, wait_s: float) -> list[WorkItem]:
        """Lease up to ``limit`` items (expired leases first); wait up to ``wait_s`` for one."""
        ...

    async def extend(self, consumer: str, items: Sequence[WorkItem]) -> None:
        """Renew the leases of items ``consumer`` is still working on."""
        ...

    async def complete(self, item: WorkItem, body: bytes) -> bool:
        """Store the item's result and drop it from the queue; False if one was stored before."""
        ...

    async def retry(self, item: WorkItem, delay_s: float) -> None:
        """Give the item back for another attempt, not before ``delay_s`` (at the latest, when
        its lease expires)."""
        ...

    async def job(self, job_id: str) -> JobState | None:
        """The job's state, or None when it does not exist (or has expired)."""
        ...

    async def results(self, job_id: str) -> list[ItemResult]:
        """The results stored so far, by item index."""
        ...

    async def purge_expired(self) -> int:
        """Remove expired jobs; returns how many were removed."""
        ...

    async def aclose(self) -> None: ...
