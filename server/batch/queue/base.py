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
from typing import Literal, Protocol

import msgspec

JobStatus = Literal["queued", "running", "done"]


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
    trace_context: str | None = None
    """The submitting span's ``traceparent`` stored with the job; ``None``: no link (tracing
    was off, or the job was queued before jobs kept it)."""


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


class QueueDepth(msgspec.Struct, frozen=True, kw_only=True):
    """Items not finished yet, across every job and gateway."""

    items: int
    """Waiting or leased."""
    leased: int
    """Held by a worker now."""
    oldest_age_s: float | None
    """Age of the oldest unfinished item (``None``: none)."""


class BatchQueue(Protocol):
    """A durable queue of batch items with leases and exactly-once results."""

    async def depth(self) -> QueueDepth:
        """How much work is queued (the dashboard's batches page)."""
        ...

    async def submit(
        self,
        job_id: str,
        tenant: str,
        model: str,
        payloads: Sequence[bytes],
        *,
        trace_context: str | None = None,
    ) -> None:
        """Store a job and all its items atomically (all or nothing); ``trace_context``: the
        submitter's ``traceparent``, handed back on each claimed item."""
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
