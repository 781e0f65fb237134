"""Asynchronous batches (Workers AI ``queueRequest``): submission, polling, and the workers.

Submitting stores every item in the durable queue (``semcache.queue``) and answers at once.
The workers of each gateway *pull* items, and only when a backend has idle capacity: before
claiming an item, and again before running it, a :class:`BackendGate` checks that the
backend's servers are under the per-server limit live traffic uses and, by default, that no
synchronous request is in flight on it. So a burst of batch work never queues in front of a
synchronous request: sync first, batch on idle capacity. Items go through the same serving
path as live requests, so they use (and fill) the caches.

A worker renews the leases of the items it holds; when a gateway dies, its items return to
the queue when their leases expire and another worker (or the restarted gateway) runs them.
Results are stored idempotently, so every item has exactly one result.
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
from typing import Annotated, Any, Literal, Protocol, TypeGuard

import msgspec
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.protocol import RequestContext
from backends.registry import ModelRegistry
from semcache.queue import BatchQueue, JobState, QueueSettings, WorkItem
from server.errors import ApiError

log = logging.getLogger("semcache.batch")

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class BatchSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[batch]`` section of the gateway config."""

    enabled: bool = True
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    max_items: PosInt = 1000
    """Most items one batch may hold (a larger one is refused with a 400 naming this limit)."""
    per_server_limit: PosInt | None = 8
    """Batch work starts only while some server of the backend runs fewer requests than this
    (and than the backend's own per-server limit, where it has one)."""
    max_inflight: PosInt = 16
    """Most batch items one gateway runs at once (on idle capacity only)."""
    yield_to_sync: bool = True
    """Start batch items only while no synchronous request is in flight on their backend."""
    sync_idle_s: NonNegFloat = 0.5
    """...and none has been seen for this long (live traffic often comes in bursts). Batch
    items resumed between live requests share the backend's steps with the next one and
    delay its first token (on a CPU backend, by 2-3x with 0.1 s; ``bench/batch_queue.py``);
    a shorter wait gives batches more throughput under steady live traffic."""
    preempt: bool = True
    """A synchronous request arriving on a backend stops the batch items running there; they
    go back to the queue and run again on the next idle capacity."""
    max_preemptions: NonNegInt = 3
    """An item stopped this many times runs to its end (batch work must not starve)."""
    max_attempts: PosInt = 5
    """Tries of an item whose backend failed (unreachable, timeout, overloaded) before it is
    answered with the error."""
    retry_delay_s: NonNegFloat = 2.0
    unserved_delay_s: NonNegFloat = 5.0
    """An item for a model this gateway does not serve is given back for this long, so that
    a gateway that serves it takes it."""
    capacity_poll_s: PosFloat = 0.01
    """How often the gates look at the backends' load while batch work waits for capacity or
    runs (the backends' counters have no event). Idle workers never poll: they block on the
    queue until an item is submitted."""
    idle_wait_s: PosFloat = 5.0
    """Longest single wait of an idle worker on the queue (a blocking read, woken at once by a
    submission); leases of dead workers are looked for at least this often."""


# -- what one item produces ------------------------------------------------------------


class ItemOutcome(msgspec.Struct, kw_only=True):
    """The answer to one batch item, as the Workers-AI serving object computed it."""

    success: bool
    result: Any = None
    errors: list[dict[str, Any]] = msgspec.field(default_factory=list)
    usage: dict[str, int] | None = None
    retryable: bool = False
    """The backend failed (not the request): trying again later may succeed."""


class StoredItem(msgspec.Struct, kw_only=True):
    """What the queue keeps per finished item: its response object and its token usage."""

    response: dict[str, Any]
    usage: dict[str, int] | None = None


class ItemRunner(Protocol):
    """Runs one item of a batch through the serving path (caches included)."""

    async def run_item(
        self, model: str, body: dict[str, Any], ctx: RequestContext
    ) -> ItemOutcome: ...


def response_object(
    index: int, outcome: ItemOutcome, external_reference: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": index,
        "result": outcome.result if outcome.success else None,
        "success": outcome.success,
        "external_reference": external_reference,
    }
    if not outcome.success:
        out["errors"] = outcome.errors
    return out


USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def sum_usage(usages: list[dict[str, int] | None]) -> dict[str, int]:
    total = dict.fromkeys(USAGE_KEYS, 0)
    for u in usages:
        for k in USAGE_KEYS:
            v = (u or {}).get(k)
            if isinstance(v, int):
                total[k] += v
    return total


# -- submission and polling -----------------------------------------------------------


class BatchService:
    """Accepts batches and answers polls; never runs items itself."""

    def __init__(self, queue: BatchQueue, settings: BatchSettings) -> None:
        self.queue = queue
        self.settings = settings

    async def submit(self, tenant: str, model: str, requests: Any) -> dict[str, Any]:
        """Queue ``requests`` (the items) for ``model``; the ``queued`` result to answer."""
        if not isinstance(requests, list) or not requests:
            raise ApiError(
                400,
                "A queued request needs `requests`: a non-empty list of inputs.",
                param="requests",
                code="invalid_value",
            )
        limit = self.settings.max_items
        if len(requests) > limit:
            raise ApiError(
                400,
                f"Too many items in `requests`: {len(requests)}; "
                f"the limit is {limit} items per batch.",
                param="requests",
                code="too_many_items",
            )
        for i, item in enumerate(requests):
            if not isinstance(item, dict):
                raise ApiError(
                    400,
                    f"Invalid value for 'requests[{i}]': expected an object.",
                    param=f"requests[{i}]",
                    code="invalid_value",
                )
            ref = item.get("external_reference")
            if ref is not None and not isinstance(ref, str):
                raise ApiError(
                    400,
                    f"Invalid value for 'requests[{i}].external_reference': expected a string.",
                    param=f"requests[{i}].external_reference",
                    code="invalid_value",
                )
        job_id = str(uuid.uuid4())
        await self.queue.submit(job_id, tenant, model, [orjson.dumps(r) for r in requests])
        return {"status": "queued", "request_id": job_id, "model": model}

    async def state(self, tenant: str, request_id: Any) -> JobState:
        if not isinstance(request_id, str) or not request_id:
            raise ApiError(
                400, "`request_id` must be a string.", param="request_id", code="invalid_value"
            )
        state = await self.queue.job(request_id)
        if state is None or state.tenant != tenant:
            # Another tenant's batch is indistinguishable from one that does not exist.
            raise ApiError(
                404, f"No queued request with id `{request_id}`.", code="request_not_found"
            )
        return state

    async def poll(self, tenant: str, request_id: Any) -> dict[str, Any]:
        """The batch's status while it runs; its responses and usage once it is done."""
        state = await self.state(tenant, request_id)
        if state.status != "done":
            return {"status": state.status, "request_id": state.id}
        decoder = msgspec.json.Decoder(StoredItem)
        stored = [decoder.decode(r.body) for r in await self.queue.results(state.id)]
        return {
            "responses": [s.response for s in stored],
            "usage": sum_usage([s.usage for s in stored]),
        }


# -- capacity -----------------------------------------------------------------------


class CapacityProbe(Protocol):
    """What a backend client reports about its load (``VllmClient`` has it)."""

    def inflight(self) -> int: ...

    def has_capacity(self, per_server_limit: int | None = None) -> bool: ...


class BackendGate:
    """Lets batch items onto one backend only while it has idle capacity."""

    def __init__(
        self,
        probe: CapacityProbe | None,
        settings: BatchSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.settings = settings
        self.running = 0
        """Batch items this gateway runs on the backend now."""
        self._clock = clock
        self._sync_seen = -1e9
        self._arrival: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def sync_inflight(self) -> int:
        if self.probe is None:
            return 0
        return max(0, self.probe.inflight() - self.running)

    def free(self) -> bool:
        if self.running >= self.settings.max_inflight:
            return False
        if self.probe is None:
            return True  # an in-process backend: only the gateway's own limit applies
        if not self.probe.has_capacity(self.settings.per_server_limit):
            return False
        if not self.settings.yield_to_sync:
            return True
        return not self.sync_busy()

    def sync_busy(self) -> bool:
        """A synchronous request is in flight, or was less than ``sync_idle_s`` ago."""
        now = self._clock()
        if self.sync_inflight() > 0:
            self._sync_seen = now
            return True
        return now - self._sync_seen < self.settings.sync_idle_s

    async def wait_free(self) -> None:
        while not self.free():  # noqa: ASYNC110 (the backend's counters have no event)
            await asyncio.sleep(self.settings.capacity_poll_s)

    def sync_arrival(self) -> asyncio.Future[None]:
        """Done when a live request comes for the backend: announced by the route
        (:meth:`live_request`) or seen in the backend's load. One future (and one watcher) is
        shared by all the batch items running there."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
            self._watcher = asyncio.create_task(self._watch_sync(self._arrival))
        return self._arrival

    async def _watch_sync(self, arrival: asyncio.Future[None]) -> None:
        # Catches live requests no route announced (e.g. the OpenAI routes).
        while self.probe is None or self.sync_inflight() == 0:  # noqa: ASYNC110 (no event)
            await asyncio.sleep(self.settings.capacity_poll_s)
        self._sync_seen = self._clock()
        if not arrival.done():
            arrival.set_result(None)

    def live_request(self) -> None:
        """A live request for this backend is about to be sent: batch work stops now, before
        the request reaches the backend, and waits ``sync_idle_s`` after the last one."""
        self._sync_seen = self._clock()
        if self.settings.yield_to_sync and self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    async def acquire(self) -> None:
        await self.wait_free()
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        if self.running == 0:  # nothing left to preempt: stop watching
            if self._watcher is not None:
                self._watcher.cancel()
            if self._arrival is not None and not self._arrival.done():
                self._arrival.cancel()
            self._watcher = self._arrival = None


class CapacityGates:
    """One gate per backend, found from the model an item names."""

    def __init__(self, registry: ModelRegistry, settings: BatchSettings) -> None:
        self.registry = registry
        self.settings = settings
        self._gates: dict[str, BackendGate] = {}
        self._fallback = BackendGate(None, settings)

    def for_backend(self, name: str) -> BackendGate:
        gate = self._gates.get(name)
        if gate is None:
            backend = self.registry.generation.get(name)
            probe = backend if _is_probe(backend) else None
            gate = self._gates[name] = BackendGate(probe, self.settings)
        return gate

    def for_model(self, model: str) -> BackendGate:
        info = self.registry.resolve(model)
        return self._fallback if info is None else self.for_backend(info.backend_name)

    def live_request(self, backend: str) -> None:
        """Announce a live request for ``backend`` (see :meth:`BackendGate.live_request`)."""
        gate = self._gates.get(backend)
        if gate is not None:
            gate.live_request()

    def any_free(self) -> bool:
        names = set(self.registry.generation) | set(self.registry.embedding)
        return any(self.for_backend(n).free() for n in names) or not names

    async def wait_any_free(self) -> None:
        while not self.any_free():  # noqa: ASYNC110 (the backend's counters have no event)
            await asyncio.sleep(self.settings.capacity_poll_s)


def _is_probe(backend: object) -> TypeGuard[CapacityProbe]:
    return callable(getattr(backend, "inflight", None)) and callable(
        getattr(backend, "has_capacity", None)
    )


# -- workers --------------------------------------------------------------------------


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.items = Counter(
            "semcache_batch_items",
            "Batch items finished, by outcome (success, failure, duplicate).",
            ["outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "semcache_batch_retries",
            "Batch items given back after a backend failure.",
            registry=registry,
        )
        self.preemptions = Counter(
            "semcache_batch_preemptions",
            "Batch items stopped (and queued again) because a live request arrived.",
            registry=registry,
        )
        self.unserved = Counter(
            "semcache_batch_unserved",
            "Batch items given back because this gateway does not serve their model.",
            registry=registry,
        )
        self.running = Gauge(
            "semcache_batch_running", "Batch items this gateway runs now.", registry=registry
        )


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
    ) -> None:
        self.queue = queue
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
            ctx = RequestContext(request_id=f"{item.job_id}:{item.index}", tenant=item.tenant)
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
            stored = StoredItem(
                response=response_object(item.index, outcome, external_reference),
                usage=outcome.usage,
            )
            fresh = await self.queue.complete(item, msgspec.json.encode(stored))
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
