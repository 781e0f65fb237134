"""The batch workers of one gateway: they pull items on idle capacity and run them.

Workers *pull* an item only when a capacity gate says its backend is idle, and run it through
the same serving path as live requests (so items use and fill the caches). A live request
arriving preempts the items running on its backend: they go back to the queue. A worker
renews the leases of the items it holds; when a gateway dies, its items return to the queue
when their leases expire and another worker (or the restarted gateway) runs them. Results
are stored idempotently, so every item has exactly one result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import orjson

from foundation import tracing as spans
from foundation.request import RequestContext
from foundation.tracing import Tracing
from server.batch.gates import BackendGate, CapacityGates
from server.batch.metrics import BatchMetrics
from server.batch.queue.base import BatchQueue, WorkItem
from server.batch.results import ItemOutcome, ItemRunner, StoredItem, response_object
from server.batch.settings import BatchSettings
from server.batch.traces import item_span
from server.envelope.queue_tickets import Tickets

log = logging.getLogger("semcache.batch")


Outcome = Literal["success", "failure", "duplicate"]


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BatchWorkers:
    """The pull loop of one gateway: claims items on idle capacity and runs them."""

    def __init__(
        self,
        queue: BatchQueue,
        runner: ItemRunner,
        gates: CapacityGates,
        settings: BatchSettings,
        metrics: BatchMetrics,
        *,
        consumer: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        accounting: Callable[[RequestContext, bool], None] | None = None,
        tracing: Tracing | None = None,
        tickets: Tickets | None = None,
    ) -> None:
        self.queue = queue
        self.tickets = tickets
        """Each item's place in a full pool's queue: the ``batch`` band, below live traffic."""
        self.tracing = tracing
        """Each item its own trace, linked to its batch's submit (``server/batch/traces.py``)."""
        self.accounting = accounting
        """Told of each item this gateway finished first (its context, and whether it
        succeeded): the usage ledger and the limits count batch items too."""
        self.runner = runner
        self.gates = gates
        self.settings = settings
        self.metrics = metrics
        self.consumer = consumer or consumer_name()
        self._clock = clock
        self._held: dict[str, WorkItem] = {}
        self._interrupted: list[WorkItem] = []
        self._preempted: dict[tuple[str, int], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._slots = asyncio.Semaphore(settings.max_inflight)
        self.finished: dict[Outcome, int] = {"success": 0, "failure": 0, "duplicate": 0}

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._pull(), name="batch-pull"),
            asyncio.create_task(self._renew(), name="batch-renew"),
            asyncio.create_task(self._purge(), name="batch-purge"),
        ]

    async def aclose(self) -> None:
        """Stop pulling; items still running go back to the queue for the next worker."""
        for task in self._loops:
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        for item in self._interrupted:
            with contextlib.suppress(Exception):
                await self.queue.retry(item, 0.0)
        self._interrupted.clear()

    async def _pull(self) -> None:
        backoff = 0.5
        while True:
            await self._slots.acquire()
            try:
                await self.gates.wait_any_free()
                items = await self.queue.claim(self.consumer, 1, wait_s=self.settings.idle_wait_s)
            except asyncio.CancelledError:
                self._slots.release()
                raise
            except Exception:
                self._slots.release()
                log.exception("batch queue unavailable; retrying in %.1f s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.5
            if not items:
                self._slots.release()
                continue
            for item in items:
                self._held[item.receipt] = item
                task = asyncio.create_task(self._process(item))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _renew(self) -> None:
        every = max(0.05, self.settings.queue.lease_s / 3)
        while True:
            await asyncio.sleep(every)
            held = list(self._held.values())
            try:
                await self.queue.extend(self.consumer, held)
            except Exception:
                log.exception("could not renew %d batch leases", len(held))

    async def _purge(self) -> None:
        every = min(60.0, max(0.5, self.settings.queue.results_ttl_s / 4))
        while True:
            try:
                removed = await self.queue.purge_expired()
                if removed:
                    log.info("removed %d expired batches", removed)
            except Exception:
                log.exception("could not purge expired batches")
            await asyncio.sleep(every)

    async def _run(
        self, item: WorkItem, body: dict[str, Any], ctx: RequestContext, gate: BackendGate
    ) -> ItemOutcome | None:
        """Run the item; None when a live request arrived first and the item was stopped."""
        key = (item.job_id, item.index)
        preemptible = (
            self.settings.preempt
            and self.settings.yield_to_sync
            and self._preempted.get(key, 0) < self.settings.max_preemptions
        )
        if not preemptible:
            return await self.runner.run_item(item.model, body, ctx)
        run = asyncio.create_task(self.runner.run_item(item.model, body, ctx))
        try:
            arrival: asyncio.Future[Any] = gate.sync_arrival()
            await asyncio.wait({run, arrival}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not run.done():
                run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        if run.cancelled():
            if len(self._preempted) > 100_000:  # items finished by other gateways stay here
                self._preempted.clear()
            self._preempted[key] = self._preempted.get(key, 0) + 1
            return None
        self._preempted.pop(key, None)
        return run.result()

    async def _process(self, item: WorkItem) -> None:
        tracing = self.tracing
        if tracing is None:
            await self._process_item(item)
            return
        token = spans.activate(tracing)
        try:
            with item_span(tracing, item):
                await self._process_item(item)
        finally:
            spans.reset(token)

    async def _process_item(self, item: WorkItem) -> None:
        acquired = False
        try:
            if self.gates.registry.resolve(item.model) is None:
                # Submitted to a gateway that serves this model: leave it to one of those.
                self.metrics.unserved.inc()
                await self.queue.retry(item, self.settings.unserved_delay_s)
                return
            gate = self.gates.for_model(item.model)
            body = orjson.loads(item.payload)
            external_reference = body.pop("external_reference", None)
            await gate.acquire()
            acquired = True
            self.metrics.running.inc()
            ticket = self.tickets.ticket(item.tenant, batch=True) if self.tickets else None
            ctx = RequestContext(
                request_id=f"{item.job_id}:{item.index}",
                tenant=item.tenant,
                background=True,
                queue=ticket,
            )
            try:
                outcome = await self._run(item, body, ctx, gate)
            finally:
                gate.release()
                acquired = False
                self.metrics.running.dec()
            if outcome is None:  # stopped for a live request: back to the queue, as it was
                self.metrics.preemptions.inc()
                await self.queue.retry(item, 0.0)
                return
            if outcome.retryable and item.attempts < self.settings.max_attempts:
                self.metrics.retries.inc()
                await self.queue.retry(item, self.settings.retry_delay_s)
                return
            response = outcome.response
            if response is None:
                response = response_object(item.index, outcome, external_reference)
            stored = StoredItem(
                response=response,
                usage=outcome.usage,
            )
            fresh = await self.queue.complete(item, msgspec.json.encode(stored))
            if fresh and self.accounting is not None:
                self.accounting(ctx, outcome.success)
            kind: Outcome = (
                "duplicate" if not fresh else "success" if outcome.success else "failure"
            )
            self.finished[kind] += 1
            self.metrics.items.labels(kind).inc()
        except asyncio.CancelledError:
            self._interrupted.append(item)
            raise
        except Exception:
            # A bug or a queue outage: the lease expires and the item is tried again.
            log.exception("batch item %s[%d] failed", item.job_id, item.index)
        finally:
            if acquired:
                gate.release()
            self._held.pop(item.receipt, None)
            self._slots.release()
