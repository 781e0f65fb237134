"""A server under test (its URL, how a hit shows, its CPU time) and the checks made of it
before the load: priming, answer sizes, idle CPU, the gateway's non-hit counters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import orjson
import psutil

from bench.lib.exact_hit.workload import BODIES, KIND_LABEL, KINDS, PATHS, REQUEST_HEADERS, Kind
from bench.lib.support import GATEWAY_EMBEDDINGS_ID, stderr_printer
from harness.metrics import metric_value

NOT_HITS = (
    "semcache_exact_misses_total",
    "semcache_exact_expired_total",
    "semcache_exact_bypasses_total",
)
"""The gateway's exact-cache lookups that reach the backend (for embeddings: no vLLM)."""

say = stderr_printer("exact_hit")


def thread_cpu_ns(pid: int) -> int:
    """Time on CPU of every live thread of ``pid`` (``/proc/PID/task/*/schedstat``, in ns).

    ``cpu_times()`` counts in 10 ms clock ticks, too coarse for short runs; the servers'
    threads (event loop, thread pool) live as long as the process.
    """
    total = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            with open(f"{task.path}/schedstat") as stat:
                total += int(stat.read().split()[0])
    return total


@dataclass
class Target:
    """A server under test: where it listens, how its hits show, its CPU time."""

    name: str
    url: str
    client: httpx.AsyncClient
    """For priming and checking only; the load is wrk's."""
    pid: int
    hit_header: str | None
    """A response header that must be present (and not MISS) on a cache hit; None: no cache."""
    hit_value: str | None = None
    kinds: tuple[Kind, ...] = KINDS
    """The requests it serves (LiteLLM: chat only, no embeddings model behind it here)."""
    procs: list[psutil.Process] = field(default_factory=list)

    def track_cpu(self) -> None:
        """Remember the server's processes (LiteLLM may have children) for CPU accounting."""
        root = psutil.Process(self.pid)
        self.procs = [root, *root.children(recursive=True)]

    def cpu_s(self) -> float:
        """CPU time of the server's threads so far: Linux's ns counters, else clock ticks."""
        total = 0.0
        for proc in self.procs:
            try:
                total += thread_cpu_ns(proc.pid) / 1e9
            except OSError:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    total += t.user + t.system
        return total

    def miss_reason(self, headers: httpx.Headers) -> str | None:
        if self.hit_header is None:
            return None
        value = headers.get(self.hit_header)
        if not value or (self.hit_value is not None and value != self.hit_value):
            return f"not a cache hit ({self.hit_header}: {value!r})"
        return None


async def one_request(target: Target, kind: Kind) -> tuple[str | None, int]:
    """Send the request once; returns (what was wrong or None, response bytes)."""
    url = target.url + PATHS[kind]
    client = target.client
    if kind != "sse":
        r = await client.post(url, content=BODIES[kind], headers=REQUEST_HEADERS)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}", len(r.content)
        if not r.content.startswith(b"{"):
            return f"not a JSON answer: {r.content[:100]!r}", len(r.content)
        if kind == "embeddings" and not _one_vector(r.content):
            return f"not one embedding: {r.content[:100]!r}", len(r.content)
        return target.miss_reason(r.headers), len(r.content)
    raw = bytearray()
    async with client.stream("POST", url, content=BODIES[kind], headers=REQUEST_HEADERS) as r:
        async for chunk in r.aiter_raw():
            raw += chunk
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {bytes(raw[:200])!r}", len(raw)
        if not raw.rstrip().endswith(b"data: [DONE]"):
            return f"stream ended without [DONE]: ...{bytes(raw[-120:])!r}", len(raw)
        return target.miss_reason(r.headers), len(raw)


def _one_vector(content: bytes) -> bool:
    """An OpenAI embeddings answer holding one non-empty float vector."""
    data = orjson.loads(content).get("data")
    return (
        isinstance(data, list)
        and len(data) == 1
        and isinstance(data[0].get("embedding"), list)
        and len(data[0]["embedding"]) > 0
    )


async def prime(target: Target, tries: int = 5) -> None:
    """Send each request until it is a hit (the first is a miss that fills the cache)."""
    for kind in target.kinds:
        problem: str | None = "never sent"
        for _ in range(tries):
            problem, _ = await one_request(target, kind)
            if problem is None:
                break
            await asyncio.sleep(0.2)
        if problem is not None:
            raise RuntimeError(
                f"{target.name}: the {KIND_LABEL[kind]} request never became a hit: {problem}"
            )


async def not_hits(target: Target) -> float:
    """The gateway's exact-cache lookups of the embeddings model that were not hits."""
    labels = {"model": GATEWAY_EMBEDDINGS_ID}
    return sum([await metric_value(target.url, name, labels, target.client) for name in NOT_HITS])


async def answer_sizes(target: Target) -> str:
    sizes = [f"{(await one_request(target, kind))[1]} B {kind}" for kind in target.kinds]
    return ", ".join(sizes)


async def idle_load(targets: Sequence[Target], seconds: float) -> dict[str, float]:
    """CPU seconds per second each server spends while nobody sends it anything."""
    say(f"measuring the servers' idle load for {seconds:g} s")
    before = {t.name: t.cpu_s() for t in targets}
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - started
    return {t.name: (t.cpu_s() - before[t.name]) / wall for t in targets}
