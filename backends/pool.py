"""The servers of one vLLM backend as pools: limits, a bounded wait queue, health, metrics.

A pool is the servers of one role (monolithic ``both``, ``prefill`` or ``decode``). Each
server runs at most ``limit`` requests of this gateway at once; a request that finds every
acceptable server full waits in the pool's queue (at most ``max_queue`` waiters, at most
``queue_timeout_s``), past which it is refused as ``overloaded`` (HTTP 429 with Retry-After)
instead of piling up. A server is ejected when it refuses connections, or fails three health
checks in a row without answering any request in between (a saturated server answers
``/health`` late, yet works); the first health check it passes re-admits it. A pool with no
server left refuses as ``unavailable`` (HTTP 503 with Retry-After).

``BackendCollector`` exposes all of it, plus a copy of each server's own ``vllm:`` prefix-cache
and KV counters (scraped with the health checks), to the gateway's Prometheus registry.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from backends.config import ServerRole, VllmBackend, VllmServer
from backends.protocol import BackendError
from backends.upstream import HTTP_ERRORS, HttpSession

log = logging.getLogger("semcache.backends")

HEALTH_FAILURES_TO_EJECT = 3
"""Failed health checks in a row that eject a server. A refused connection ejects at once; an
answer relayed from the server in between wipes the count (a busy server answers slowly)."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_SCRAPED_FAMILIES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
_SCRAPED_PREFIXES = ("vllm:nixl_",)
"""Histograms of these families are copied as their ``_sum`` and ``_count`` only."""
_DROPPED_LABELS = frozenset({"engine", "model_name"})

PoolRole = ServerRole


@dataclass(frozen=True)
class UpstreamSample:
    """One sample of a server's own ``/metrics`` page, as last scraped."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    counter: bool


@dataclass(eq=False)
class ServerState:
    """One vLLM server as the gateway sees it."""

    config: VllmServer
    limit: int
    inflight: int = 0
    healthy: bool = True
    health_failures: int = 0
    requests: int = 0
    ejections: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    upstream: list[UpstreamSample] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def role(self) -> ServerRole:
        return self.config.role

    @property
    def free(self) -> bool:
        return self.healthy and self.inflight < self.limit


@dataclass(frozen=True)
class ServerLoad:
    """A server's load as the batch queue and dashboards read it."""

    url: str
    role: ServerRole
    inflight: int
    limit: int
    healthy: bool


class Lease:
    """One request's slot on one server; ``release`` (idempotent) frees it."""

    def __init__(self, pool: Pool, server: ServerState) -> None:
        self.pool = pool
        self.server = server
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pool._release(self.server)


class Pool:
    """The servers of one role, with per-server limits and a bounded FIFO wait queue."""

    def __init__(
        self,
        backend: str,
        role: PoolRole,
        servers: Sequence[ServerState],
        *,
        max_queue: int,
        queue_timeout_s: float,
        retry_after_s: int,
        unavailable_retry_after_s: int,
    ) -> None:
        self.backend = backend
        self.role = role
        self.servers = list(servers)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.unavailable_retry_after_s = unavailable_retry_after_s
        self.waiting = 0
        self.refused: Counter[str] = Counter()
        """Requests refused, by kind (``overloaded`` → 429, ``unavailable`` → 503)."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers if s.healthy]

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        """Some healthy server runs fewer requests than its limit (or ``per_server_limit``)."""
        return any(
            s.healthy and s.inflight < min(s.limit, per_server_limit or s.limit)
            for s in self.servers
        )

    def loads(self) -> list[ServerLoad]:
        return [ServerLoad(s.url, s.role, s.inflight, s.limit, s.healthy) for s in self.servers]

    def _unavailable(self) -> BackendError:
        self.refused["unavailable"] += 1
        return BackendError(
            "unavailable",
            f"no healthy {self.role} server for backend {self.backend}",
            retry_after_s=self.unavailable_retry_after_s,
        )

    def _overloaded(self, why: str) -> BackendError:
        self.refused["overloaded"] += 1
        return BackendError(
            "overloaded",
            f"backend {self.backend} is overloaded ({why})",
            retry_after_s=self.retry_after_s,
        )

    def _take(self, order: Iterable[ServerState]) -> Lease | None:
        for server in order:
            if server.free:
                server.inflight += 1
                server.requests += 1
                return Lease(self, server)
        return None

    def try_acquire(self, order: Iterable[ServerState]) -> Lease | None:
        """A slot on the first free server of ``order`` now, or None (never waits)."""
        if self._waiters:
            return None  # first come, first served: waiters go before newcomers
        return self._take(order)

    async def acquire(self, rank: Callable[[], Sequence[ServerState]]) -> Lease:
        """A slot on the first free server ``rank()`` names (re-ranked after each wait).

        Raises ``BackendError("unavailable")`` when no server is healthy and
        ``BackendError("overloaded")`` when the queue is full or the wait too long.
        """
        if not self.healthy():
            raise self._unavailable()
        lease = self.try_acquire(rank())
        if lease is not None:
            return lease
        if self.waiting >= self.max_queue:
            raise self._overloaded(f"{self.waiting} requests already wait")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters.append(waiter)
                try:
                    async with asyncio.timeout_at(deadline):
                        await waiter
                except BaseException as exc:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    elif waiter.done() and not waiter.cancelled():
                        self._wake_one()  # woken, but leaving: pass the free slot on
                    if isinstance(exc, TimeoutError):
                        why = f"no free server within {self.queue_timeout_s:g} s"
                        raise self._overloaded(why) from None
                    raise
                if not self.healthy():
                    raise self._unavailable()
                lease = self._take(rank())
                if lease is not None:
                    if self._waiters and any(s.free for s in self.servers):
                        self._wake_one()
                    return lease
        finally:
            self.waiting -= 1

    def _release(self, server: ServerState) -> None:
        server.inflight -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def eject(self, server: ServerState) -> None:
        """Stop sending requests to ``server`` until a health check passes."""
        if server.healthy:
            server.healthy = False
            server.ejections += 1
            log.warning("backend %s: %s server %s ejected", self.backend, self.role, server.url)
            self._wake_all()  # waiters re-check: maybe nothing is left

    def answered(self, server: ServerState) -> None:
        """``server`` just answered a request: it is alive, whatever its health checks said."""
        server.health_failures = 0

    def readmit(self, server: ServerState) -> None:
        server.health_failures = 0
        if not server.healthy:
            server.healthy = True
            log.warning("backend %s: %s server %s re-admitted", self.backend, self.role, server.url)
            self._wake_all()


class LatencyHistogram:
    """A Prometheus-style cumulative histogram kept in plain numbers."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(bound), float(running)))
        return out


@dataclass(eq=False)
class BackendStats:
    """Everything ``BackendCollector`` exposes about one backend."""

    name: str
    pools: list[Pool]
    hops: Counter[str] = field(default_factory=Counter)
    """P/D hops: ``prefill``, ``decode``, ``decode_retry``."""
    prefill_skipped: Counter[str] = field(default_factory=Counter)
    """Why a request went to decode alone: ``short_prompt``, ``prefill_down``, ..."""
    prefill_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    handoff_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    """From the prefill answer to the decode server's first byte: KV pull + first step."""


def build_pools(config: VllmBackend) -> tuple[Pool | None, Pool]:
    """``(prefill pool or None, the pool that answers)`` for a backend's servers."""

    def states(role: ServerRole) -> list[ServerState]:
        return [
            ServerState(s, s.max_inflight or config.max_inflight_per_server)
            for s in config.servers
            if s.role == role
        ]

    common = {
        "max_queue": config.max_queue,
        "queue_timeout_s": config.queue_timeout_s,
        "retry_after_s": config.retry_after_s,
        "unavailable_retry_after_s": max(1, math.ceil(config.health_interval_s)),
    }
    decode_servers = states("decode")
    if not decode_servers:
        both = states("both")
        if not both:
            raise ValueError(f"backend {config.name!r} has no servers")
        return None, Pool(config.name, "both", both, **common)  # type: ignore[arg-type]
    prefill_servers = states("prefill")
    prefill = Pool(config.name, "prefill", prefill_servers, **common) if prefill_servers else None  # type: ignore[arg-type]
    return prefill, Pool(config.name, "decode", decode_servers, **common)  # type: ignore[arg-type]


def _scraped(family: str) -> bool:
    return family in _SCRAPED_FAMILIES or family.startswith(_SCRAPED_PREFIXES)


def parse_upstream_metrics(text: str) -> list[UpstreamSample]:
    """The samples of a vLLM ``/metrics`` page that the gateway re-exposes."""
    out: list[UpstreamSample] = []
    for family in text_string_to_metric_families(text):
        if not _scraped(family.name):
            continue
        histogram = family.type == "histogram"
        for sample in family.samples:
            if histogram and not sample.name.endswith(("_sum", "_count")):
                continue
            if sample.name.endswith("_created"):
                continue
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in _DROPPED_LABELS)
            )
            out.append(UpstreamSample(sample.name, labels, sample.value, family.type == "counter"))
    return out


class HealthMonitor:
    """Checks every server's ``/health`` periodically; ejects and re-admits; scrapes metrics."""

    def __init__(
        self,
        http: HttpSession,
        pools: Sequence[Pool],
        *,
        interval_s: float,
        timeout_s: float,
        scrape_metrics: bool,
    ) -> None:
        self.http = http
        self.pools = list(pools)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.scrape_metrics = scrape_metrics
        self.last_check = 0.0
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start the periodic checks in the running loop (first use; again if they died)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        """One round of checks over every server, concurrently."""
        await asyncio.gather(*(self._check(p, s) for p in self.pools for s in p.servers))
        self.last_check = time.monotonic()

    async def _check(self, pool: Pool, server: ServerState) -> None:
        session = self.http.session
        try:
            async with session.get(f"{server.url}/health", timeout=self._timeout) as response:
                ok = response.status == 200
                await response.read()  # to the end: the connection goes back to the pool
        except aiohttp.ClientConnectorError:
            pool.eject(server)  # nothing listens: no point in a second try
            return
        except HTTP_ERRORS:
            ok = False
        if not ok:
            server.health_failures += 1
            if server.health_failures >= HEALTH_FAILURES_TO_EJECT:
                pool.eject(server)
            return
        pool.readmit(server)
        if self.scrape_metrics:
            with contextlib.suppress(*HTTP_ERRORS, ValueError):
                async with session.get(f"{server.url}/metrics", timeout=self._timeout) as page:
                    text = await page.text() if page.status == 200 else None
                if text is not None:
                    server.upstream = await asyncio.to_thread(parse_upstream_metrics, text)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class BackendCollector:
    """A Prometheus collector over the gateway's vLLM backends (anything with ``.stats``).

    Register it once: ``app.state.metrics.registry.register(BackendCollector(
    registry.generation.values()))``; the dict view is read at every scrape.
    """

    def __init__(self, backends: Iterable[object]) -> None:
        self.backends = backends

    def _stats(self) -> Iterator[BackendStats]:
        for backend in self.backends:
            stats = getattr(backend, "stats", None)
            if isinstance(stats, BackendStats):
                yield stats

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        server_labels = ["backend", "server", "role"]
        inflight = GaugeMetricFamily(
            "semcache_backend_server_inflight",
            "Requests open on a vLLM server.",
            labels=server_labels,
        )
        limit = GaugeMetricFamily(
            "semcache_backend_server_limit",
            "Concurrency limit of a vLLM server.",
            labels=server_labels,
        )
        healthy = GaugeMetricFamily(
            "semcache_backend_server_healthy", "1 while a server is admitted.", labels=server_labels
        )
        requests = CounterMetricFamily(
            "semcache_backend_server_requests", "Requests sent to a server.", labels=server_labels
        )
        errors = CounterMetricFamily(
            "semcache_backend_server_errors",
            "Failed requests by server and kind.",
            labels=[*server_labels, "kind"],
        )
        ejections = CounterMetricFamily(
            "semcache_backend_server_ejections", "Times a server was ejected.", labels=server_labels
        )
        waiting = GaugeMetricFamily(
            "semcache_backend_queue_waiting",
            "Requests waiting for a free server.",
            labels=["backend", "role"],
        )
        refused = CounterMetricFamily(
            "semcache_backend_refused",
            "Requests refused by a pool (overloaded → 429, unavailable → 503).",
            labels=["backend", "role", "kind"],
        )
        hops = CounterMetricFamily(
            "semcache_pd_hops", "Prefill/decode hops sent.", labels=["backend", "hop"]
        )
        skipped = CounterMetricFamily(
            "semcache_pd_prefill_skipped",
            "Requests decoded without a prefill hop, by reason.",
            labels=["backend", "reason"],
        )
        prefill_s = HistogramMetricFamily(
            "semcache_pd_prefill_seconds", "Duration of prefill hops.", labels=["backend"]
        )
        handoff_s = HistogramMetricFamily(
            "semcache_pd_kv_handoff_seconds",
            "From the prefill answer to the decode server's first byte (KV pull + first step).",
            labels=["backend"],
        )
        upstream: dict[str, Metric] = {}
        for stats in self._stats():
            for pool in stats.pools:
                waiting.add_metric([stats.name, pool.role], pool.waiting)
                for kind, n in pool.refused.items():
                    refused.add_metric([stats.name, pool.role, kind], n)
                for s in pool.servers:
                    key = [stats.name, s.url, s.role]
                    inflight.add_metric(key, s.inflight)
                    limit.add_metric(key, s.limit)
                    healthy.add_metric(key, 1.0 if s.healthy else 0.0)
                    requests.add_metric(key, s.requests)
                    ejections.add_metric(key, s.ejections)
                    for kind, n in s.errors.items():
                        errors.add_metric([*key, kind], n)
                    for sample in s.upstream:
                        _add_upstream(upstream, sample, key)
            for hop, n in stats.hops.items():
                hops.add_metric([stats.name, hop], n)
            for reason, n in stats.prefill_skipped.items():
                skipped.add_metric([stats.name, reason], n)
            prefill_s.add_metric(
                [stats.name], stats.prefill_seconds.cumulative(), stats.prefill_seconds.sum
            )
            handoff_s.add_metric(
                [stats.name], stats.handoff_seconds.cumulative(), stats.handoff_seconds.sum
            )
        yield from (inflight, limit, healthy, requests, errors, ejections, waiting, refused)
        yield from (hops, skipped, prefill_s, handoff_s)
        yield from upstream.values()


def _add_upstream(families: dict[str, Metric], sample: UpstreamSample, key: list[str]) -> None:
    """Re-expose a scraped ``vllm:x`` sample as ``semcache_upstream_vllm_x`` with our labels."""
    name = "semcache_upstream_" + sample.name.replace(":", "_")
    extra = [k for k, _ in sample.labels]
    family = families.get(name)
    if family is None:
        labels = ["backend", "server", "role", *extra]
        doc = f"{sample.name} as last scraped from each vLLM server."
        if sample.counter and name.endswith("_total"):
            family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
        else:
            family = GaugeMetricFamily(name, doc, labels=labels)
        families[name] = family
    family.add_metric([*key, *(v for _, v in sample.labels)], sample.value)  # type: ignore[attr-defined]
