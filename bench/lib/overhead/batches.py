"""Batches of requests and sustained windows against one target, with the wall time, the
client's CPU and the gateway's (net of its idle burn) of each."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import psutil

from backends.scraped_metrics import parse_upstream_metrics
from bench.lib.overhead.cells import Cell
from bench.lib.overhead.chat import Sample, Target, chat_body, one_request
from bench.lib.support import REPO

CPU_BURN = REPO / "bench" / "lib" / "cpu_burn.py"


@dataclass
class Batch:
    """Requests measured together (sent at once, or kept in flight for a while); throughput
    is measured over their wall time."""

    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    vllm_queue: list[tuple[float, float]] = field(default_factory=list)
    """(running, waiting) requests in vLLM, sampled during a sustained window."""

    @property
    def tokens(self) -> int:
        return sum(s.completion_tokens for s in self.samples)

    def add(self, sample: Sample, max_tokens: int) -> None:
        self.samples.append(sample)
        if sample.completion_tokens != max_tokens:
            self.errors.append(f"{sample.completion_tokens} tokens, not {max_tokens}")


def cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return float(times.user + times.system)


async def idle_cpu(pid: int, seconds: float) -> float:
    """CPU seconds per second that process ``pid`` uses while nothing is sent to it."""
    process = psutil.Process(pid)
    cpu, started = cpu_seconds(process), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(process) - cpu) / (time.perf_counter() - started)


class Meter:
    """Wall time, this client's CPU and the gateway's (net of what it burns idle) from now."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.server = psutil.Process(target.server_pid) if target.server_pid else None
        self.server_cpu = cpu_seconds(self.server)
        self.client_cpu = time.process_time()
        self.started = time.perf_counter()

    def stop(self, batch: Batch) -> Batch:
        batch.wall_s = time.perf_counter() - self.started
        batch.client_cpu_s = time.process_time() - self.client_cpu
        idle = self.target.server_idle_cpu * batch.wall_s
        batch.server_cpu_s = cpu_seconds(self.server) - self.server_cpu - idle
        return batch


async def run_batch(target: Target, cell: Cell, uids: Iterator[int], max_tokens: int) -> Batch:
    bodies = [
        chat_body(target.model, next(uids), max_tokens, cell.stream)
        for _ in range(cell.concurrency)
    ]
    meter = Meter(target)
    results = await asyncio.gather(
        *(one_request(target, body, cell.stream) for body in bodies), return_exceptions=True
    )
    batch = meter.stop(Batch())
    for result in results:
        if isinstance(result, Sample):
            batch.add(result, max_tokens)
        elif isinstance(result, Exception):
            batch.errors.append(f"{type(result).__name__}: {result}")
        else:
            raise result
    return batch


async def run_sustained(
    target: Target,
    cell: Cell,
    uids: Iterator[int],
    max_tokens: int,
    seconds: float,
    *,
    vllm_url: str | None = None,
    burn_fraction: float | None = None,
) -> Batch:
    """``cell.concurrency`` requests kept in flight for ``seconds`` (each worker sends its next
    request as soon as its last one ends); the wall time runs until the last one ends.

    ``vllm_url``: sample vLLM's running and waiting requests while the window is full.
    ``burn_fraction``: burn that share of this process's core(s) meanwhile
    (``lib/cpu_burn.py``).
    """
    batch = Batch()
    burner = (
        await asyncio.create_subprocess_exec(sys.executable, str(CPU_BURN), str(burn_fraction))
        if burn_fraction is not None
        else None
    )
    try:
        meter = Meter(target)
        deadline = meter.started + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                body = chat_body(target.model, next(uids), max_tokens, cell.stream)
                try:
                    batch.add(await one_request(target, body, cell.stream), max_tokens)
                except Exception as exc:  # counted; the worker stops (no error storm)
                    batch.errors.append(f"{type(exc).__name__}: {exc}")
                    return

        sampler = (
            asyncio.create_task(sample_vllm_queue(vllm_url, meter.started + 1.0, deadline, batch))
            if vllm_url
            else None
        )
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
        if sampler is not None:
            await sampler
        return meter.stop(batch)
    finally:
        if burner is not None:
            burner.kill()
            await burner.wait()


async def sample_vllm_queue(url: str, start: float, end: float, batch: Batch) -> None:
    """vLLM's running and waiting requests every 0.25 s from ``start`` to ``end``."""
    wanted = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 1}
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        while time.perf_counter() < end:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{url}/metrics") as response:
                    gauges = [0.0, 0.0]
                    for sample in parse_upstream_metrics(await response.text()):
                        if sample.name in wanted:
                            gauges[wanted[sample.name]] += sample.value
                    batch.vllm_queue.append((gauges[0], gauges[1]))
            await asyncio.sleep(0.25)
