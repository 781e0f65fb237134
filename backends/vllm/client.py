"""Async OpenAI-protocol client for one vLLM backend: a monolithic or a prefill/decode pool.

One pooled aiohttp session per backend (``backends.upstream``); the servers are organised in
pools (``backends.fleet.pool``) and each request is placed and, when the backend is disaggregated,
sent through prefill and decode (``backends.vllm.router``).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from backends.config import ServerRole, VllmBackendConfig, VllmServer
from backends.fleet.dispatch_gate import DispatchGate
from backends.fleet.health import HealthMonitor
from backends.fleet.kv.service import KvPlacement
from backends.fleet.pool import Pool, build_pools
from backends.fleet.pool_metrics import BackendStats
from backends.fleet.salt import CacheSalter
from backends.fleet.server_state import ServerLoad, ServerState
from backends.interfaces import UpstreamResponse
from backends.upstream import HTTP_ERRORS, HttpSession
from backends.vllm.router import PDRouter
from backends.vllm.stream import VllmStream
from foundation.request import RequestContext


class VllmClient:
    """Sends OpenAI-protocol requests to the servers of one vLLM backend.

    ``stats`` feeds ``backends.fleet.pool_metrics.BackendCollector`` (per-server in-flight, errors,
    ejections, P/D hops, KV hand-off latency, the servers' own prefix-cache counters).
    """

    def __init__(
        self,
        config: VllmBackendConfig,
        salter: CacheSalter | None = None,
    ) -> None:
        """``salter``: default from the config."""
        self.config = config
        self.name = config.name
        self.served_model = config.served_model
        self.prefill_pool, self.decode_pool = build_pools(config)
        pools = [p for p in (self.prefill_pool, self.decode_pool) if p is not None]
        self.stats = BackendStats(config.name, pools)
        self._max_model_len: int | None = None
        self._http = HttpSession(
            max_connections=config.max_connections,
            read_timeout_s=config.read_timeout_s,
            connect_timeout_s=config.connect_timeout_s,
        )
        self.monitor = HealthMonitor(
            self._http,
            pools,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            scrape_metrics=config.scrape_metrics,
            scrape_idle_interval_s=config.scrape_idle_interval_s,
            gate=DispatchGate(
                max_waiting=config.hold_above_waiting, max_kv_usage=config.hold_above_kv_usage
            ),
            # no pinned revision and no files to hash: the servers' report is the revision
            served_model=(
                config.served_model if not config.revision and config.model_path is None else None
            ),
        )
        if salter is None and config.cache_salt:
            salter = CacheSalter.from_config(config)
        self.kv = KvPlacement(config) if config.placement == "kv" else None
        """KV placement's feeds, index and scorer (``placement = "kv"``)."""
        self.stats.kv = self.kv
        self.router = PDRouter(
            config,
            self._http,
            self.prefill_pool,
            self.decode_pool,
            self.stats,
            self.monitor,
            salter,
            self.kv,
        )

    @property
    def disaggregated(self) -> bool:
        """True when the backend has prefill and decode pools (the prefill one maybe empty)."""
        return self.prefill_pool is not None

    @property
    def pools(self) -> list[Pool]:
        return self.stats.pools

    def pool(self, role: ServerRole) -> Pool | None:
        return next((p for p in self.stats.pools if p.role == role), None)

    async def add_server(
        self, role: ServerRole, url: str, max_inflight: int | None = None
    ) -> ServerState:
        """A server joins the ``role`` pool while the backend serves, health-checked first
        (one that fails the check joins ejected; the next check that passes admits it)."""
        pool = self.pool(role)
        if pool is None:
            raise ValueError(f"backend {self.name!r} has no {role} pool")
        server = ServerState(
            VllmServer(url=url.rstrip("/"), role=role, max_inflight=max_inflight),
            max_inflight or self.config.max_inflight_per_server,
        )
        pool.add(server)
        await self.monitor.check(pool, server)
        return server

    def drain_server(self, role: ServerRole, url: str) -> tuple[Pool, ServerState]:
        """The server at ``url`` takes nothing new; ``Pool.wait_drained`` waits for it
        (draining one that already drains finds it again).

        The last server of the answering pool cannot leave (every request would be a 503);
        the last prefill server can (decode then computes prompts alone)."""
        pool = self.pool(role)
        if pool is not None:
            url = url.rstrip("/")
            leaving = next((s for s in pool.leaving() if s.url == url), None)
            if leaving is not None:
                return pool, leaving
        server = pool.find(url) if pool is not None else None
        if pool is None or server is None:
            raise LookupError(f"no {role} server {url} in backend {self.name!r}")
        if pool is self.decode_pool and len(pool.servers) == 1:
            raise ValueError(f"{url} is the last {role} server of backend {self.name!r}")
        pool.drain(server)
        if self.kv is not None:
            self.kv.forget(server.url)
        return pool, server

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        return await self.router.post(path, body, ctx)

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> VllmStream:
        return await self.router.open_stream(path, body, ctx)

    async def fetch(self, path: str, ctx: RequestContext) -> UpstreamResponse | None:
        """``GET path`` from the answering servers, healthy ones first, until one answers
        other than 404: each vLLM server keeps the responses it made itself."""
        servers = sorted(self.decode_pool.servers, key=lambda s: not s.healthy)
        found: UpstreamResponse | None = None
        for server in servers:
            try:
                async with self._http.session.get(
                    server.url + path,
                    headers={"x-request-id": ctx.request_id},
                    timeout=aiohttp.ClientTimeout(
                        sock_connect=self.config.connect_timeout_s,
                        sock_read=self.config.read_timeout_s,
                    ),
                ) as r:
                    found = UpstreamResponse(
                        status=r.status,
                        body=await r.read(),
                        content_type=r.headers.get("content-type", "application/json"),
                    )
            except HTTP_ERRORS:
                continue
            if found.status != 404:
                return found
        return found

    async def ready(self) -> bool:
        """Check every server now; ready while the answering pool has a healthy server."""
        self.monitor.ensure_running()
        await self.monitor.check_all()
        if self.kv is not None:
            await self.kv.ready()  # the tokenizer: placement falls back to the hash until then
        return bool(self.decode_pool.healthy())

    async def aclose(self) -> None:
        if self.kv is not None:
            await self.kv.aclose()
        await self.monitor.aclose()
        await self._http.aclose()

    # -- capacity: read by the batch workers, which only run on idle capacity --------

    def inflight(self) -> int:
        """Requests this client has open right now (sync and batch), counted once each."""
        return sum(s.inflight for s in self.decode_pool.servers)

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        """True when some healthy answering server runs fewer requests than its limit
        (or than ``per_server_limit``, when that is lower)."""
        return self.decode_pool.has_capacity(per_server_limit)

    def capacity(self) -> list[ServerLoad]:
        """In-flight requests against the limit, per server of every pool."""
        loads = [] if self.prefill_pool is None else self.prefill_pool.loads()
        return loads + self.decode_pool.loads()

    async def max_model_len(self) -> int | None:
        """The smallest context length the servers report (``/v1/models``), asked once some
        server is healthy."""
        if self._max_model_len is None:
            lengths: list[int] = []
            healthy = [load for load in self.capacity() if load.healthy]
            if not healthy:
                return None
            for s in healthy:
                try:
                    async with self._http.session.get(
                        f"{s.url}/v1/models", timeout=aiohttp.ClientTimeout(total=5.0)
                    ) as r:
                        cards = orjson.loads(await r.read()).get("data") or []
                except (*HTTP_ERRORS, orjson.JSONDecodeError, AttributeError):
                    return None
                lengths += [
                    c["max_model_len"]
                    for c in cards
                    if isinstance(c, dict) and isinstance(c.get("max_model_len"), int)
                ]
            self._max_model_len = min(lengths) if lengths else 0
        return self._max_model_len or None
