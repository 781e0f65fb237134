"""This gateway's asynchronous batches, built once by the app factory: the durable queue, the
service that accepts and polls jobs, and the workers that run queued items on idle capacity.

Every API that queues items registers the runner of its items (by the payload's marker key;
the default runner takes the rest); the serving core announces each live request to the
workers' gates (``live_request``), so batch items running on that backend yield first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from backends.registry import ModelRegistry
from foundation.request import RequestContext
from foundation.tracing import Tracing
from server.batch.dispatch import ItemDispatch
from server.batch.gates import CapacityGates
from server.batch.metrics import BatchMetrics
from server.batch.queue import open_queue
from server.batch.queue.base import BatchQueue
from server.batch.results import ItemRunner
from server.batch.service import BatchService
from server.batch.settings import BatchSettings
from server.batch.workers import BatchWorkers
from server.envelope.queue_tickets import Tickets
from server.errors import ApiError


class BatchSystem:
    """The queue, service and workers of ``settings`` (nothing opens while it is disabled)."""

    def __init__(
        self,
        settings: BatchSettings,
        data_dir: Path,
        registry: ModelRegistry,
        metrics_registry: CollectorRegistry,
        *,
        accounting: Callable[[RequestContext, bool], None] | None = None,
        tracing: Tracing | None = None,
        tickets: Tickets | None = None,
    ) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.registry = registry
        self.metrics_registry = metrics_registry
        self.accounting = accounting
        self.tracing = tracing
        self.tickets = tickets
        self._default: ItemRunner | None = None
        self._by_key: dict[str, ItemRunner] = {}
        self.service: BatchService | None = None
        self.workers: BatchWorkers | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def queue(self) -> BatchQueue | None:
        """The durable queue, once started."""
        return self.service.queue if self.service is not None else None

    def register(self, runner: ItemRunner, *, key: str | None = None) -> None:
        """Run the items whose payload is ``{key: ...}`` with ``runner``; without a key, every
        other item (one default runner)."""
        if key is None:
            self._default = runner
        else:
            self._by_key[key] = runner

    def accepting(self) -> BatchService:
        """The service that queues and polls jobs; a 400 when batches are off."""
        if self.service is None:
            raise ApiError(
                400, "Queued requests are disabled on this gateway.", code="batch_disabled"
            )
        return self.service

    def live_request(self, backend: str) -> None:
        """A live request is about to reach ``backend``: its batch items yield first."""
        if self.workers is not None:
            self.workers.gates.live_request(backend)

    async def start(self) -> None:
        """Open the queue and start this gateway's workers (the runners are registered)."""
        if not self.settings.enabled:
            return
        if self._default is None:
            raise RuntimeError("no default runner registered for batch items")
        queue = await open_queue(self.settings.queue, self.data_dir)
        self.service = BatchService(queue, self.settings)
        runner = ItemDispatch(self._default, self._by_key) if self._by_key else self._default
        self.workers = BatchWorkers(
            queue,
            runner,
            CapacityGates(self.registry, self.settings),
            self.settings,
            BatchMetrics(self.metrics_registry),
            accounting=self.accounting,
            tracing=self.tracing,
            tickets=self.tickets,
        )
        self.workers.start()

    async def aclose(self) -> None:
        """Workers first (their items go back to the queue), then the queue."""
        if self.workers is not None:
            await self.workers.aclose()
            self.workers = None
        if self.service is not None:
            await self.service.queue.aclose()
            self.service = None
