"""The disaggregated prefill → decode flow: the prefill hop and the decode hop's retries.

With ``connector = "nixl"``, one request id (``x-request-id``) on both hops:

1. a decode slot is reserved first (so a prefill is never wasted on a request refused later);
2. the prefill server gets the request with ``kv_transfer_params: {"do_remote_decode": true}``,
   ``max_tokens: 1``, ``stream: false`` (no ``stream_options``/``min_tokens``; a Responses
   API request: ``max_output_tokens: 1`` and ``store: false``);
3. the decode server gets the original request plus the ``kv_transfer_params`` of the prefill
   answer, pulls the KV blocks and answers; its answer (stream or not) is relayed untouched, so
   usage counts the prompt once and the stream has a monolithic server's shape.

With ``connector = "example"`` (ExampleConnector) step 2 sends the plain request (the prefill
server writes the KV to shared storage) and step 3 the original one (decode reads it back).

Short prompts (under ``prefill_threshold_tokens``), requests with ``n``/``best_of`` > 1 or
batched prompts, Responses API requests that continue a kept response, an empty, overloaded
or failing prefill pool: the decode server computes the prompt alone. A decode server that
fails before the first byte is replaced by another (with the same KV parameters if it was
unreachable, without them if it answered an error — e.g. the KV pull failed — or broke off
its answer); a server that failed the request is tried again (without KV parameters) only
when it answered and no other server is left. After bytes were relayed a failure ends the
stream with ``BackendError``, which the server turns into an error event.

The KV hand-off is bounded (``handoff_bound_s``, at most half of the prefill's KV lease
``kv_lease_s``): vLLM's prefill server frees blocks no decode server has read within the lease,
and a decode server that reads them later answers HTTP 200 from whatever they hold by then
(vLLM only logs "Potentially invalid KV blocks"). A decode attempt with KV parameters that has
not given its first byte (a JSON answer: the whole answer) by the bound, counted from the
prefill answer, is abandoned (its connection closed, so vLLM aborts it) and the next attempt
goes without the parameters: decode computes the prompt itself. The first byte of a stream
comes after the first generated token, hence after the KV pull; an answer relayed with KV
parameters was therefore pulled inside the lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson

from backends.config import VllmBackendConfig
from backends.fleet.admission import Lease
from backends.fleet.placement import Placement, PromptShape, RouteKey
from backends.fleet.pool import Pool
from backends.fleet.pool_metrics import BackendStats
from backends.fleet.server_state import ServerState
from backends.interfaces import BackendError
from backends.upstream import HTTP_ERRORS, HttpSession, http_failure, stream_timeout
from foundation import tracing as spans
from foundation.request import RequestContext

_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
_SERVER_STATE = ("previous_response_id", "conversation")
"""Responses API fields that name what a server kept (a prefill server does not have it)."""
GENERATION_PATHS = ("/chat/completions", "/completions", "/responses")
"""The paths whose requests generate (and may be prefilled); any other (``/tokenize``,
``/score``, …) goes to one answering server as it is, with no ``cache_salt``."""
NOT_GENERATION = "not_generation"


def generates(path: str) -> bool:
    return path.endswith(GENERATION_PATHS)


T = TypeVar("T")


@dataclass
class Plan:
    """One request's route: its upstream body, its placement key and whether to prefill."""

    path: str
    body: dict[str, Any]
    key: RouteKey
    prefill: bool
    skip_reason: str | None
    uncached_tokens: int | None = None
    """Prompt tokens the decode server chosen lacks, from the index (None: unknown)."""


def hop_headers(ctx: RequestContext, stream: bool) -> dict[str, str]:
    """The headers of a hop; with tracing on, the current span's ``traceparent`` too, so the
    vLLM server's spans join the request's trace under the hop's span."""
    headers = {"content-type": "application/json", "x-request-id": ctx.request_id}
    if stream:
        headers["accept"] = "text/event-stream"
    spans.inject(headers)
    return headers


def with_params(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    return body if params is None else {**body, "kv_transfer_params": params}


class PrefillHop:
    """Step 2: computes the prompt's KV on a prefill server (or says why decode goes alone)."""

    def __init__(
        self,
        config: VllmBackendConfig,
        http: HttpSession,
        pool: Pool | None,
        stats: BackendStats,
        placement: Placement,
    ) -> None:
        self.config = config
        self.http = http
        self.pool = pool
        self.stats = stats
        self.placement = placement

    def skip_reason(
        self, body: dict[str, Any], shape: PromptShape, exact: bool = False
    ) -> str | None:
        """Why this request goes to decode alone, or None to prefill it.

        ``exact``: the prompt's blocks are known, so the threshold is applied later to the
        tokens the chosen decode server lacks (``PDRouter``); else to the estimated length."""
        if self.pool is None or not self.pool.servers:
            return "no_prefill_pool"
        if not shape.single or (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
            return "unsupported"
        if any(body.get(k) for k in _SERVER_STATE):
            return "unsupported"  # the prompt continues what only the decode server kept
        if not exact and shape.approx_tokens < self.config.prefill_threshold_tokens:
            return "short_prompt"
        return None

    def body(self, body: dict[str, Any], path: str = "") -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
        out["stream"] = False
        if path.endswith("/responses"):
            out["max_output_tokens"] = 1
            out["store"] = False  # the prefill's one-token answer is kept nowhere
            out.pop("background", None)
        else:
            out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        if self.config.connector == "nixl":
            out["kv_transfer_params"] = {"do_remote_decode": True}
        return out

    def _skip(self, reason: str) -> None:
        self.stats.prefill_skipped[reason] += 1

    async def run(self, plan: Plan, ctx: RequestContext) -> tuple[bool, dict[str, Any] | None]:
        """Run the prefill hop: ``(done, kv_transfer_params)``; not done → decode alone."""
        pool = self.pool
        if pool is None or plan.skip_reason in ("no_prefill_pool", NOT_GENERATION):
            return False, None  # monolithic pool, decode servers only, or no generation
        if not plan.prefill:
            self._skip(plan.skip_reason or "unknown")
            return False, None
        excluded: set[ServerState] = set()
        for _ in range(2):  # a second prefill server if the first is unreachable
            if not self.placement.any_healthy(pool.servers, excluded):
                self._skip("prefill_down")
                return False, None
            try:
                lease = await pool.admission.acquire(
                    lambda: self.placement.rank(pool.servers, plan.key, excluded), ctx.queue
                )
            except BackendError as exc:
                self._skip("prefill_down" if exc.kind == "unavailable" else "prefill_overloaded")
                return False, None
            server = lease.server
            kv = self.placement.kv
            if kv is not None and plan.key.blocks:  # its backlog, until the answer
                cached = kv.cached_tokens(server, plan.key.blocks, plan.key.block_size)
                lease.charge(max(0, plan.key.prompt_tokens - cached))
            self.stats.hops["prefill"] += 1
            started = time.perf_counter()
            try:
                with spans.span("prefill", {"semcache.server": server.url}) as span:
                    response = await self.http.post(
                        server.url + plan.path,
                        orjson.dumps(self.body(plan.body, plan.path)),
                        hop_headers(ctx, stream=False),
                        stream_timeout(
                            self.config.prefill_timeout_s, self.config.connect_timeout_s
                        ),
                    )
                    try:
                        status, content = response.status, await response.read()
                    finally:
                        response.release()
                    if span is not None:
                        span.set_attribute("http.response.status_code", status)
            except HTTP_ERRORS as exc:
                failure = http_failure(exc, server.url)
                pool.failed(server, failure)
                if failure.kind != "unreachable":
                    self._skip("prefill_failed")
                    return False, None
                excluded.add(server)
                continue
            finally:
                lease.release()
            self.stats.prefill_seconds.observe(time.perf_counter() - started)
            pool.answered(server)
            ctx.usage.servers.append(server.url)
            if status != 200:
                # decode alone gives the authoritative answer (or the same error)
                server.errors[f"status_{status}"] += 1
                self._skip("prefill_rejected")
                return False, None
            if self.config.connector != "nixl":
                ctx.usage.pd_hop = True
                return True, None
            try:
                params = orjson.loads(content).get("kv_transfer_params")
            except (orjson.JSONDecodeError, AttributeError):
                params = None
            if not isinstance(params, dict):
                self._skip("no_kv_params")
                return False, None
            ctx.usage.pd_hop = True
            return True, params
        self._skip("prefill_down")
        return False, None


class DecodeHop:
    """Step 3: the decode hop, tried on up to ``decode_attempts`` servers before a first byte."""

    def __init__(
        self, config: VllmBackendConfig, pool: Pool, stats: BackendStats, placement: Placement
    ) -> None:
        self.attempts = config.decode_attempts
        self.bound_s = config.handoff_deadline_s
        self.lease_s = config.kv_lease_s
        self.pool = pool
        self.stats = stats
        self.placement = placement

    async def _next_lease(
        self, plan: Plan, unanswered: set[ServerState], failed: set[ServerState]
    ) -> Lease | None:
        """A decode slot for a retry: on a server this request has not failed on, else on one
        that answered it with a failure (``failed``; it may recompute the prompt), never on one
        that gave no answer (``unanswered``: refused, reset, timed out); None when none is
        left."""
        pool = self.pool
        excluded = unanswered | failed
        if not self.placement.any_healthy(pool.servers, excluded):
            excluded = unanswered
            if not self.placement.any_healthy(pool.servers, excluded):
                return None
        try:
            return await pool.admission.acquire(
                lambda: self.placement.rank(pool.servers, plan.key, excluded)
            )
        except BackendError:
            return None

    async def run(
        self,
        plan: Plan,
        first: Lease,
        params: dict[str, Any] | None,
        attempt: Callable[[Lease, dict[str, Any]], Awaitable[T | BackendError]],
        *,
        prefilled_at: float | None = None,
        answer: Literal["json", "stream"] = "json",
    ) -> T:
        """``attempt`` on ``first``'s server, then on others until one answers.

        ``attempt(lease, body)`` tries the lease's server with this body and returns the answer,
        or the ``BackendError`` of a server that answered but failed (retried elsewhere without
        KV parameters, on the same server only when no other is left); it raises
        ``HTTP_ERRORS`` for an unreachable one (retried elsewhere with the same KV parameters).
        An answer owns the lease; a failure leaves it to this loop.
        With KV parameters, an attempt must return by the hand-off bound counted from
        ``prefilled_at`` (``time.perf_counter()`` at the prefill answer); past it the next
        attempt, on any server, goes without them.
        """
        lease: Lease | None = first
        unanswered: set[ServerState] = set()
        failed: set[ServerState] = set()
        failure: BackendError | None = None
        for n in range(self.attempts):
            if lease is None:
                break
            server = lease.server
            self.stats.hops["decode" if n == 0 else "decode_retry"] += 1
            limit: float | None = None
            if params is not None and prefilled_at is not None:
                limit = self.bound_s - (time.perf_counter() - prefilled_at)
                if limit <= 0:  # e.g. a retry after an unreachable server came too late
                    self.stats.handoff_over_bound[answer] += 1
                    params, limit = None, None
            deadline = asyncio.timeout(limit)
            try:
                with spans.span("decode") as span:
                    if span is not None:
                        span.set_attributes({"semcache.server": server.url, "semcache.attempt": n})
                        span.set_attribute("semcache.kv", params is not None)
                    async with deadline:
                        outcome = await attempt(lease, with_params(plan.body, params))
            except HTTP_ERRORS as exc:
                if deadline.expired():
                    # Not the server's fault (it may just be busy): no ejection, and it may
                    # take the next attempt, which computes the prompt itself.
                    self.stats.handoff_over_bound[answer] += 1
                    failure = BackendError(
                        "timeout",
                        f"KV hand-off to {server.url} passed {self.bound_s:g} s "
                        f"(the prefill's KV lease is {self.lease_s} s)",
                        retry_after_s=1,
                    )
                    params = None
                    lease.release()
                    lease = None
                    if n + 1 < self.attempts:
                        lease = await self._next_lease(plan, unanswered, failed)
                    continue
                failure = http_failure(exc, server.url)
                unanswered.add(server)
            except BaseException:
                lease.release()
                raise
            else:
                if not isinstance(outcome, BackendError):
                    return outcome
                failure = outcome
                failed.add(server)
                params = None  # e.g. the KV pull failed: the next try computes the prompt
            lease.release()
            self.pool.failed(server, failure)
            lease = None
            if n + 1 < self.attempts:
                lease = await self._next_lease(plan, unanswered, failed)
        assert failure is not None
        raise failure
