"""Where a request goes and how: placement (``backends.fleet.placement``) tied to the P/D flow.

Each request is planned (its upstream body with the tenant's ``cache_salt``, its placement key,
whether to prefill), a decode slot is reserved, the prefill hop runs when planned, then the
decode hop with its retries (``backends.vllm.pd_flow``); the answer is relayed untouched, whole
(``post``) or as a stream (``open_stream``, ``backends.vllm.stream``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from backends.config import VllmBackendConfig
from backends.fleet.admission import Lease
from backends.fleet.health import HealthMonitor
from backends.fleet.kv.service import KvPlacement
from backends.fleet.placement import Placement, RouteKey, prefix_key, prompt_shape
from backends.fleet.pool import Pool
from backends.fleet.pool_metrics import BackendStats
from backends.fleet.salt import ANONYMOUS_SCOPE, CacheSalter
from backends.interfaces import BackendError, UpstreamResponse
from backends.upstream import HTTP_ERRORS, HttpSession, body_failure
from backends.vllm.pd_flow import (
    NOT_GENERATION,
    DecodeHop,
    Plan,
    PrefillHop,
    generates,
    hop_headers,
)
from backends.vllm.stream import VllmStream, is_server_error_event, read_first_event
from foundation import tracing as spans
from foundation.request import RequestContext


def placement_attributes(plan: Plan, server: str) -> dict[str, str | bool]:
    """What the placement span says: the decode server chosen and why, and the prefill plan."""
    key = plan.key
    reason = "session" if key.session else "prefix" if key.prefix else "least_loaded"
    return {
        "semcache.server": server,
        "semcache.placement.reason": reason,
        "semcache.prefill": plan.prefill,
        "semcache.prefill.skip_reason": plan.skip_reason or "",
    }


UNSALTED_PATHS = ("/tokenize", "/detokenize")
"""Paths that compute nothing with the KV cache (vLLM's tokenizer alone): no ``cache_salt``."""


class PDRouter:
    """Sends a request through prefill → decode (or to one server) and relays the answer."""

    def __init__(
        self,
        config: VllmBackendConfig,
        http: HttpSession,
        prefill: Pool | None,
        decode: Pool,
        stats: BackendStats,
        monitor: HealthMonitor,
        salter: CacheSalter | None,
        kv: KvPlacement | None = None,
    ) -> None:
        self.config = config
        self.http = http
        self.decode_pool = decode
        self.stats = stats
        self.monitor = monitor
        self.salter = salter
        self.kv = kv
        self.placement = Placement(
            config.prefix_load_slack,
            config.placement or "prefix-hash",
            kv.scorer if kv is not None else None,
        )
        self.prefill_hop = PrefillHop(config, http, prefill, stats, self.placement)
        self.decode_hop = DecodeHop(config, decode, stats, self.placement)

    def plan(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Plan:
        upstream = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        scope = ctx.salt_scope or ctx.tenant or ANONYMOUS_SCOPE
        if self.salter is not None and not path.endswith(UNSALTED_PATHS):
            upstream["cache_salt"] = self.salter.salt(scope)
        if not generates(path):  # pooling, tokenization: no KV to place or hand over
            key = RouteKey(session=ctx.session_affinity, prefix=None)
            return Plan(path, upstream, key, False, NOT_GENERATION)
        shape = prompt_shape(path, upstream, self.config.chars_per_token)
        prefix = None
        if ctx.session_affinity is None and shape.single:
            prefix = prefix_key(
                shape, scope, self.config.prefix_tokens, self.config.chars_per_token
            )
        key = RouteKey(session=ctx.session_affinity, prefix=prefix)
        if self.kv is not None and shape.single:
            # a session still pins the servers; its blocks decide the prefill hop
            route = self.kv.route(path, upstream)
            if route is not None:
                blocks, block_size, tokens = route
                key = RouteKey(
                    session=ctx.session_affinity,
                    prefix=prefix,
                    blocks=blocks,
                    block_size=block_size,
                    prompt_tokens=tokens,
                )
        reason = self.prefill_hop.skip_reason(upstream, shape, exact=key.blocks is not None)
        return Plan(path, upstream, key, reason is None, reason)

    def _decide_prefill(self, plan: Plan, decode: Lease) -> None:
        """With the prompt's blocks known, the prefill hop runs only when the decode server
        chosen lacks at least ``prefill_threshold_tokens`` of it (the index says what it
        holds); what decode then computes itself is charged to its backlog."""
        scorer = self.kv.scorer if self.kv is not None else None
        if scorer is None or plan.key.blocks is None:
            return  # a prompt shorter than one block has no blocks, and a known length
        cached = scorer.cached_tokens(decode.server, plan.key.blocks, plan.key.block_size)
        uncached = max(0, plan.key.prompt_tokens - cached)
        plan.uncached_tokens = uncached
        if plan.prefill and uncached < self.config.prefill_threshold_tokens:
            plan.prefill = False
            plan.skip_reason = "cached_on_decode" if cached else "short_prompt"
        if not plan.prefill:
            decode.charge(uncached)

    async def _begin(
        self, path: str, body: dict[str, Any], ctx: RequestContext
    ) -> tuple[Plan, Lease, float | None, dict[str, Any] | None]:
        """Plan the request, reserve its first decode slot, then run the prefill hop.

        Returns the plan, the decode lease, when the prefill answered (``perf_counter``; None
        when no prefill ran), and the KV parameters.
        """
        self.monitor.ensure_running()
        if self.kv is not None:
            self.kv.ensure_running()
        plan = self.plan(path, body, ctx)
        pool = self.decode_pool
        with spans.span("placement") as span:
            first = await pool.admission.acquire(
                lambda: self.placement.rank(pool.servers, plan.key), ctx.queue
            )
            self._decide_prefill(plan, first)
            if span is not None:
                span.set_attributes(placement_attributes(plan, first.server.url))
        try:
            prefilled, params = await self.prefill_hop.run(plan, ctx)
        except BaseException:
            first.release()
            raise
        if plan.prefill and not prefilled and plan.uncached_tokens:
            first.charge(plan.uncached_tokens)  # no hop after all: decode computes it
        return plan, first, time.perf_counter() if prefilled else None, params

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        plan, first, prefilled_at, params = await self._begin(path, body, ctx)

        async def attempt(
            lease: Lease, decode_body: dict[str, Any]
        ) -> UpstreamResponse | BackendError:
            server = lease.server
            ctx.usage.servers.append(server.url)
            response = await self.http.post(
                server.url + path, orjson.dumps(decode_body), hop_headers(ctx, stream=False)
            )
            try:
                answer = UpstreamResponse(
                    status=response.status,
                    body=await response.read(),
                    content_type=response.headers.get("content-type", "application/json"),
                )
            except HTTP_ERRORS as exc:
                return body_failure(exc, server.url)
            finally:
                response.release()
            if answer.status >= 500:
                return BackendError("broken", f"backend {server.url} answered {answer.status}")
            self.decode_pool.answered(server)
            lease.release()
            return answer

        return await self.decode_hop.run(
            plan, first, params, attempt, prefilled_at=prefilled_at, answer="json"
        )

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> VllmStream:
        plan, first, prefilled_at, params = await self._begin(path, body, ctx)

        async def attempt(lease: Lease, decode_body: dict[str, Any]) -> VllmStream | BackendError:
            server = lease.server
            ctx.usage.servers.append(server.url)
            response = await self.http.post(
                server.url + path, orjson.dumps(decode_body), hop_headers(ctx, stream=True)
            )
            relayed = False
            try:
                if response.status == 200:
                    try:
                        head, rest = await read_first_event(response)
                    except HTTP_ERRORS as exc:
                        return body_failure(exc, server.url)
                    if head and not is_server_error_event(head):
                        lease.settle()  # the prompt is computed: out of the backlog
                        self.decode_pool.answered(server)
                        if prefilled_at is not None:
                            now = time.perf_counter()
                            handoff_s = now - prefilled_at
                            self.stats.handoff_seconds.observe(handoff_s)
                            ctx.usage.pd_handoff_s = handoff_s
                            spans.record_span(
                                "kv.handoff", prefilled_at, now, {"semcache.server": server.url}
                            )
                        relayed = True
                        return self._stream(response, lease, head, rest)
                    return BackendError("broken", f"backend {server.url} failed early")
                if response.status < 500:
                    # a client error: relay it (the server reads it with read_all)
                    relayed = True
                    return self._stream(response, lease, b"", None)
                return BackendError("broken", f"backend {server.url} answered {response.status}")
            finally:
                if not relayed:
                    response.release()

        return await self.decode_hop.run(
            plan, first, params, attempt, prefilled_at=prefilled_at, answer="stream"
        )

    def _stream(
        self,
        response: aiohttp.ClientResponse,
        lease: Lease,
        head: bytes,
        rest: AsyncIterator[bytes] | None,
    ) -> VllmStream:
        server = lease.server

        def failed(failure: BackendError) -> None:
            self.decode_pool.failed(server, failure)

        return VllmStream(
            response, server.url, lease.release, head=head, rest=rest, on_failure=failed
        )
