"""The batch workers against a real disk queue: preemption by live requests, unserved models."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from server.batch.gates import CapacityGates
from server.batch.metrics import BatchMetrics
from server.batch.queue.disk import DiskQueue
from server.batch.results import ItemOutcome
from server.batch.service import BatchService
from server.batch.settings import BatchSettings
from server.batch.workers import BatchWorkers
from tests.support.waiting import wait_until_async


async def eventually(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait (bounded: a loaded CI box is slow) for a condition another task makes true."""
    await wait_until_async(check, timeout_s=timeout_s, interval_s=0.01)


class LoadedBackend:
    """A generation backend that only reports its load (the runner below does the work)."""

    name = "busy"
    served_model = "busy"

    def __init__(self) -> None:
        self.n = 0

    def inflight(self) -> int:
        return self.n

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        return self.n < (per_server_limit or 64)


class BlockingRunner:
    """Runs items until released; each run occupies the backend like a real call."""

    def __init__(self, backend: LoadedBackend) -> None:
        self.backend = backend
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = 0

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        self.calls += 1
        self.backend.n += 1
        try:
            self.started.set()
            await self.release.wait()
            return ItemOutcome(
                success=True,
                result={"response": body["prompt"]},
                usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            )
        finally:
            self.backend.n -= 1


async def test_a_live_request_preempts_batch_work_which_then_completes_once(
    tmp_path: Path,
) -> None:
    backend = LoadedBackend()
    reg = ModelRegistry()
    reg.generation["busy"] = backend  # type: ignore[assignment]
    reg.add(ModelInfo("m", "chat", ("@cf/m",), "t", "busy", "r", "n"))
    settings = BatchSettings(sync_idle_s=0.05, capacity_poll_s=0.005)
    queue = await DiskQueue.open(tmp_path / "q.sqlite3", poll_s=0.01)
    runner = BlockingRunner(backend)
    metrics = CollectorRegistry()
    workers = BatchWorkers(
        queue, runner, CapacityGates(reg, settings), settings, BatchMetrics(metrics)
    )
    service = BatchService(queue, settings)

    def preemptions() -> float | None:
        return metrics.get_sample_value("semcache_batch_preemptions_total")

    workers.start()
    try:
        queued = await service.submit(
            "acme", "@cf/m", [{"prompt": "p0", "external_reference": "r"}]
        )
        await asyncio.wait_for(runner.started.wait(), 10)
        runner.started.clear()
        backend.n += 1  # a live request starts on the backend: the batch item is stopped
        await eventually(lambda: preemptions() == 1 and backend.n == 1)
        backend.n -= 1  # the live request is done: the item runs again, to its end
        await asyncio.wait_for(runner.started.wait(), 10)
        runner.release.set()
        await eventually(lambda: workers.finished["success"] == 1)
        done = await service.poll("acme", queued["request_id"])
    finally:
        await workers.aclose()
        await queue.aclose()
    assert runner.calls == 2
    assert done == {
        "responses": [
            {"id": 0, "result": {"response": "p0"}, "success": True, "external_reference": "r"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    assert workers.finished == {"success": 1, "failure": 0, "duplicate": 0}


class EchoRunner:
    """Answers every item at once with its prompt (no backend)."""

    def __init__(self) -> None:
        self.models: list[str] = []

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        self.models.append(model)
        return ItemOutcome(success=True, result={"response": body["prompt"]})


async def test_a_gateway_leaves_items_of_models_it_does_not_serve(tmp_path: Path) -> None:
    settings = BatchSettings(unserved_delay_s=0.2)
    queue = await DiskQueue.open(tmp_path / "q.sqlite3")
    other = ModelRegistry()
    other.add(ModelInfo("x", "chat", (), "t", "busy", "r", "n"))
    serving = ModelRegistry()
    serving.generation["busy"] = LoadedBackend()  # type: ignore[assignment]
    serving.add(ModelInfo("m", "chat", ("@cf/m",), "t", "busy", "r", "n"))
    metrics = CollectorRegistry()
    runners = (EchoRunner(), EchoRunner())
    wrong = BatchWorkers(
        queue, runners[0], CapacityGates(other, settings), settings, BatchMetrics(metrics)
    )
    right = BatchWorkers(
        queue,
        runners[1],
        CapacityGates(serving, settings),
        settings,
        BatchMetrics(CollectorRegistry()),
    )
    service = BatchService(queue, settings)
    wrong.start()
    try:
        queued = await service.submit("acme", "@cf/m", [{"prompt": "p0"}])
        await eventually(
            lambda: (metrics.get_sample_value("semcache_batch_unserved_total") or 0) >= 1
        )
        assert runners[0].models == [] and wrong.finished["failure"] == 0
        # Stop the declining gateway first: both share one queue object and event loop here,
        # where the one that declined wins every race for the item when it is due again (up
        # to 45 s of re-declines on a loaded box); separate gateways race at random.
        await wrong.aclose()
        right.start()
        await eventually(lambda: right.finished["success"] == 1)
        done = await service.poll("acme", queued["request_id"])
    finally:
        await wrong.aclose()
        await right.aclose()
        await queue.aclose()
    assert runners[0].models == [] and runners[1].models == ["@cf/m"]
    assert done["responses"] == [
        {"id": 0, "result": {"response": "p0"}, "success": True, "external_reference": None}
    ]
