"""Where a request goes, and the disaggregated prefill → decode flow.

Placement, per pool (the same rules pick the prefill and the decode server):

- ``x-session-affinity: <id>`` → rendezvous (highest-random-weight) hashing of the id over the
  pool's healthy servers: a conversation stays on the same prefill and decode servers, and when
  a server joins or leaves only the sessions whose top choice it is move. A full server spills
  the session to its next choice.
- otherwise, with a prompt at least ``prefix_tokens`` long → prefix-aware placement: the
  rendezvous choice for a hash of the prompt's first ``prefix_tokens`` (estimated, see below),
  so requests sharing a system prompt land where its KV blocks are cached, unless that server
  runs more than ``prefix_load_slack`` requests above the least busy one (bounded load).
- otherwise → least outstanding requests (round-robin among ties).

Approximation: the gateway has no tokenizer. It renders the prompt cheaply (chat: tools, then
each message as ``<|role|>`` + text; completions: the prompt string) and counts
``len(text) / chars_per_token`` tokens (4 for English BPE vocabularies; token-id prompts are
counted exactly). The estimate decides the prefill threshold and the prefix window only, so an
error moves a request across the threshold or shifts the window, never changes an answer.

The P/D flow (``connector = "nixl"``), one request id (``x-request-id``) on both hops:

1. a decode slot is reserved first (so a prefill is never wasted on a request refused later);
2. the prefill server gets the request with ``kv_transfer_params: {"do_remote_decode": true}``,
   ``max_tokens: 1``, ``stream: false`` (no ``stream_options``/``min_tokens``);
3. the decode server gets the original request plus the ``kv_transfer_params`` of the prefill
   answer, pulls the KV blocks and answers; its answer (stream or not) is relayed untouched, so
   usage counts the prompt once and the stream has a monolithic server's shape.

With ``connector = "example"`` (ExampleConnector) step 2 sends the plain request (the prefill
server writes the KV to shared storage) and step 3 the original one (decode reads it back).

Short prompts (under ``prefill_threshold_tokens``), requests with ``n``/``best_of`` > 1 or
batched prompts, an empty, overloaded or failing prefill pool: the decode server computes the
prompt alone. A decode server that fails before the first byte is replaced by another (with
the same KV parameters if it was unreachable, without them if it answered an error — e.g. the
KV pull failed); after bytes were relayed a failure ends the stream with ``BackendError``,
which the server turns into an error event.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from backends.admission import Lease
from backends.config import VllmBackend
from backends.health import HealthMonitor
from backends.pool import Pool
from backends.pool_metrics import BackendStats
from backends.protocol import BackendError, RequestContext, UpstreamResponse
from backends.salt import ANONYMOUS_SCOPE, CacheSalter
from backends.servers import ServerState
from backends.upstream import HTTP_ERRORS, HttpSession, http_failure, raw_chunks, stream_timeout

PER_MESSAGE_TOKENS = 4
"""Chat-template tokens around each message (role header, separators), roughly."""

_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


# -- failures -------------------------------------------------------------------------------


def _note_failure(pool: Pool, server: ServerState, failure: BackendError) -> None:
    server.errors[failure.kind] += 1
    if failure.kind == "unreachable":
        pool.eject(server)  # the health checks re-admit it when it answers again


# -- placement ------------------------------------------------------------------------------


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: str, servers: Iterable[ServerState]) -> list[ServerState]:
    """``servers`` by decreasing rendezvous score for ``key`` (the first is the owner)."""
    return sorted(servers, key=lambda s: _hash64(f"{key}\x00{s.url}"), reverse=True)


@dataclass(frozen=True)
class RouteKey:
    """What placement may use: a session id, else a prompt-prefix hash, else nothing."""

    session: str | None = None
    prefix: str | None = None


class Placement:
    """Ranks a pool's servers for one request (see the module docstring)."""

    def __init__(self, prefix_load_slack: int) -> None:
        self.slack = prefix_load_slack
        self._rr = itertools.count()

    def least_outstanding(self, servers: Sequence[ServerState]) -> list[ServerState]:
        if not servers:
            return []
        start = next(self._rr) % len(servers)
        rotated = [*servers[start:], *servers[:start]]
        return sorted(rotated, key=lambda s: s.inflight)  # stable: ties keep the rotation

    def rank(
        self,
        servers: Sequence[ServerState],
        key: RouteKey,
        exclude: Iterable[ServerState] = (),
    ) -> list[ServerState]:
        skip = set(exclude)
        healthy = [s for s in servers if s.healthy and s not in skip]
        if key.session is not None:
            return rendezvous_order(key.session, healthy)
        by_load = self.least_outstanding(healthy)
        if key.prefix is None or not by_load:
            return by_load
        ceiling = by_load[0].inflight + self.slack
        preferred = [s for s in rendezvous_order(key.prefix, healthy) if s.inflight <= ceiling]
        return preferred + [s for s in by_load if s not in preferred]


# -- the prompt, cheaply ---------------------------------------------------------------------


@dataclass(frozen=True)
class PromptShape:
    """A prompt as placement sees it: rendered text (or token ids) and a token estimate."""

    text: str
    token_ids: tuple[int, ...] | None
    approx_tokens: int
    single: bool
    """One prompt (not a batch of completions prompts)."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                else:  # images, audio: their reference stands in for them
                    parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return ""


def prompt_shape(path: str, body: dict[str, Any], chars_per_token: float) -> PromptShape:
    """Render the prompt of a chat or completions body without a tokenizer (approximate)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        parts = []
        if body.get("tools"):
            parts.append(orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode())
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}\n")
        text = "".join(parts)
        approx = math.ceil(len(text) / chars_per_token) + PER_MESSAGE_TOKENS * len(messages)
        return PromptShape(text, None, approx, True)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptShape(prompt, None, math.ceil(len(prompt) / chars_per_token), True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptShape("", tuple(prompt), len(prompt), True)
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_shape(path, {**body, "prompt": prompt[0]}, chars_per_token)
    return PromptShape("", None, 0, False)


def prefix_key(
    shape: PromptShape, scope: str, prefix_tokens: int, chars_per_token: float
) -> str | None:
    """A hash of the prompt's first ``prefix_tokens`` (None for shorter prompts).

    The salt scope is part of it: tenants with different salts share no KV blocks anyway.
    """
    if shape.token_ids is not None:
        if len(shape.token_ids) < prefix_tokens:
            return None
        head = ",".join(map(str, shape.token_ids[:prefix_tokens]))
    else:
        window = int(prefix_tokens * chars_per_token)
        if len(shape.text) < window:
            return None
        head = shape.text[:window]
    return hashlib.blake2b(f"{scope}\x00{head}".encode(), digest_size=16).hexdigest()


# -- the relayed stream -----------------------------------------------------------------------


class VllmStream:
    """A streamed answer relayed as raw bytes; closing it aborts the request in vLLM.

    ``head`` holds bytes already read (the first event, read while a retry was still
    possible); they are yielded first.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        url: str,
        release: Callable[[], None],
        *,
        head: bytes = b"",
        rest: AsyncIterator[bytes] | None = None,
        on_failure: Callable[[BackendError], None] | None = None,
    ) -> None:
        self._response = response
        self._url = url
        self._release: Callable[[], None] | None = release
        self._head = head
        self._rest = rest
        self._on_failure = on_failure
        self.status = response.status
        self.content_type = response.headers.get("content-type", "text/event-stream")

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self._head:
                yield self._head
            async for chunk in self._rest or raw_chunks(self._response):
                yield chunk
        except HTTP_ERRORS as exc:
            failure = http_failure(exc, self._url)
            if self._on_failure is not None:
                self._on_failure(failure)
            raise failure from exc
        finally:
            await self.aclose()

    async def read_all(self) -> bytes:
        try:
            if self._rest is None:
                return self._head + await self._response.read()
            return self._head + b"".join([chunk async for chunk in self._rest])
        except HTTP_ERRORS as exc:
            raise http_failure(exc, self._url) from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
        # Back to the pool when read to the end; otherwise the connection is closed, which
        # makes vLLM abort the request.
        self._response.release()


async def _read_first_event(
    response: aiohttp.ClientResponse,
) -> tuple[bytes, AsyncIterator[bytes]]:
    """Bytes up to the end of the first SSE event (or of the stream), and the rest."""
    rest = raw_chunks(response)
    head = b""
    async for chunk in rest:
        head += chunk
        if b"\n\n" in head or b"\r\n\r\n" in head:
            break
    return head, rest


def _is_server_error_event(head: bytes) -> bool:
    """The first event is vLLM's ``{"error": {..., "code": 5xx}}`` (e.g. a failed KV pull)."""
    line = head.lstrip().split(b"\n", 1)[0]
    if not line.startswith(b"data:"):
        return False
    try:
        payload = orjson.loads(line[5:].strip())
    except orjson.JSONDecodeError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return not isinstance(code, int) or code >= 500


def _with_params(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    return body if params is None else {**body, "kv_transfer_params": params}


# -- the flow -----------------------------------------------------------------------------------


@dataclass
class Plan:
    """One request's route: its upstream body, its placement key and whether to prefill."""

    path: str
    body: dict[str, Any]
    key: RouteKey
    prefill: bool
    skip_reason: str | None


class PDRouter:
    """Sends a request through prefill → decode (or to one server) and relays the answer."""

    def __init__(
        self,
        config: VllmBackend,
        http: HttpSession,
        prefill: Pool | None,
        decode: Pool,
        stats: BackendStats,
        monitor: HealthMonitor,
        salter: CacheSalter | None,
    ) -> None:
        self.config = config
        self.http = http
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.stats = stats
        self.monitor = monitor
        self.salter = salter
        self.placement = Placement(config.prefix_load_slack)

    # -- planning

    def plan(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Plan:
        upstream = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        scope = ctx.salt_scope or ctx.tenant or ANONYMOUS_SCOPE
        if self.salter is not None:
            upstream["cache_salt"] = self.salter.salt(scope)
        shape = prompt_shape(path, upstream, self.config.chars_per_token)
        prefix = None
        if ctx.session_affinity is None and shape.single:
            prefix = prefix_key(
                shape, scope, self.config.prefix_tokens, self.config.chars_per_token
            )
        key = RouteKey(session=ctx.session_affinity, prefix=prefix)
        reason = self._skip_reason(upstream, shape)
        return Plan(path, upstream, key, reason is None, reason)

    def _skip_reason(self, body: dict[str, Any], shape: PromptShape) -> str | None:
        if self.prefill_pool is None:
            return "no_prefill_pool"
        if not shape.single or (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
            return "unsupported"
        if shape.approx_tokens < self.config.prefill_threshold_tokens:
            return "short_prompt"
        return None

    # -- hops

    def _headers(self, ctx: RequestContext, stream: bool) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-request-id": ctx.request_id}
        if stream:
            headers["accept"] = "text/event-stream"
        return headers

    def _prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
        out["stream"] = False
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        if self.config.connector == "nixl":
            out["kv_transfer_params"] = {"do_remote_decode": True}
        return out

    def _skip(self, reason: str) -> None:
        self.stats.prefill_skipped[reason] += 1

    async def _prefill(self, plan: Plan, ctx: RequestContext) -> tuple[bool, dict[str, Any] | None]:
        """Run the prefill hop: ``(done, kv_transfer_params)``; not done → decode alone."""
        pool = self.prefill_pool
        if pool is None:
            return False, None  # monolithic pool, or decode servers only
        if not plan.prefill:
            self._skip(plan.skip_reason or "unknown")
            return False, None
        excluded: set[ServerState] = set()
        for _ in range(2):  # a second prefill server if the first is unreachable
            if not self.placement.rank(pool.servers, plan.key, excluded):
                self._skip("prefill_down")
                return False, None
            try:
                lease = await pool.admission.acquire(
                    lambda: self.placement.rank(pool.servers, plan.key, excluded)
                )
            except BackendError as exc:
                self._skip("prefill_down" if exc.kind == "unavailable" else "prefill_overloaded")
                return False, None
            server = lease.server
            self.stats.hops["prefill"] += 1
            started = time.perf_counter()
            try:
                response = await self.http.post(
                    server.url + plan.path,
                    orjson.dumps(self._prefill_body(plan.body)),
                    self._headers(ctx, stream=False),
                    stream_timeout(self.config.prefill_timeout_s, self.config.connect_timeout_s),
                )
                try:
                    status, content = response.status, await response.read()
                finally:
                    response.release()
            except HTTP_ERRORS as exc:
                failure = http_failure(exc, server.url)
                _note_failure(pool, server, failure)
                if failure.kind != "unreachable":
                    self._skip("prefill_failed")
                    return False, None
                excluded.add(server)
                continue
            finally:
                lease.release()
            self.stats.prefill_seconds.observe(time.perf_counter() - started)
            pool.answered(server)
            if status != 200:
                # decode alone gives the authoritative answer (or the same error)
                server.errors[f"status_{status}"] += 1
                self._skip("prefill_rejected")
                return False, None
            if self.config.connector != "nixl":
                return True, None
            try:
                params = orjson.loads(content).get("kv_transfer_params")
            except (orjson.JSONDecodeError, AttributeError):
                params = None
            if not isinstance(params, dict):
                self._skip("no_kv_params")
                return False, None
            return True, params
        self._skip("prefill_down")
        return False, None

    async def _begin(
        self, path: str, body: dict[str, Any], ctx: RequestContext
    ) -> tuple[Plan, Lease, bool, dict[str, Any] | None]:
        """Plan the request, reserve its first decode slot, then run the prefill hop.

        Returns the plan, the decode lease, whether prefill ran, and the KV parameters.
        """
        self.monitor.ensure_running()
        plan = self.plan(path, body, ctx)
        pool = self.decode_pool
        first = await pool.admission.acquire(lambda: self.placement.rank(pool.servers, plan.key))
        try:
            prefilled, params = await self._prefill(plan, ctx)
        except BaseException:
            first.release()
            raise
        return plan, first, prefilled, params

    async def _next_decode_lease(self, plan: Plan, excluded: set[ServerState]) -> Lease | None:
        """Another decode slot for a retry, or None when no other server is left."""
        pool = self.decode_pool
        if not self.placement.rank(pool.servers, plan.key, excluded):
            return None
        try:
            return await pool.admission.acquire(
                lambda: self.placement.rank(pool.servers, plan.key, excluded)
            )
        except BackendError:
            return None

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        plan, first, _, params = await self._begin(path, body, ctx)
        lease: Lease | None = first
        excluded: set[ServerState] = set()
        failure: BackendError | None = None
        for attempt in range(self.config.decode_attempts):
            if lease is None:
                break
            server = lease.server
            self.stats.hops["decode" if attempt == 0 else "decode_retry"] += 1
            decode_body = _with_params(plan.body, params)
            try:
                response = await self.http.post(
                    server.url + path, orjson.dumps(decode_body), self._headers(ctx, stream=False)
                )
                try:
                    answer = UpstreamResponse(
                        status=response.status,
                        body=await response.read(),
                        content_type=response.headers.get("content-type", "application/json"),
                    )
                finally:
                    response.release()
            except HTTP_ERRORS as exc:
                failure = http_failure(exc, server.url)
                excluded.add(server)
            else:
                if answer.status < 500:
                    self.decode_pool.answered(server)
                    return answer
                failure = BackendError("broken", f"backend {server.url} answered {answer.status}")
                params = None  # e.g. the KV pull failed: the next try computes the prompt
            finally:
                lease.release()
            _note_failure(self.decode_pool, server, failure)
            lease = None
            if attempt + 1 < self.config.decode_attempts:
                lease = await self._next_decode_lease(plan, excluded)
        assert failure is not None
        raise failure

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> VllmStream:
        plan, first, prefilled, params = await self._begin(path, body, ctx)
        lease: Lease | None = first
        handoff_from = time.perf_counter()
        excluded: set[ServerState] = set()
        failure: BackendError | None = None
        for attempt in range(self.config.decode_attempts):
            if lease is None:
                break
            server = lease.server
            self.stats.hops["decode" if attempt == 0 else "decode_retry"] += 1
            decode_body = _with_params(plan.body, params)
            response: aiohttp.ClientResponse | None = None
            try:
                response = await self.http.post(
                    server.url + path, orjson.dumps(decode_body), self._headers(ctx, stream=True)
                )
                if response.status == 200:
                    head, rest = await _read_first_event(response)
                    if head and not _is_server_error_event(head):
                        self.decode_pool.answered(server)
                        if prefilled:
                            self.stats.handoff_seconds.observe(time.perf_counter() - handoff_from)
                        return self._stream(response, lease, head, rest)
                    failure = BackendError("broken", f"backend {server.url} failed early")
                    params = None
                elif response.status < 500:
                    # a client error: relay it (the server reads it with read_all)
                    return self._stream(response, lease, b"", None)
                else:
                    failure = BackendError(
                        "broken", f"backend {server.url} answered {response.status}"
                    )
                    params = None
            except HTTP_ERRORS as exc:
                failure = http_failure(exc, server.url)
                excluded.add(server)
            except BaseException:
                if response is not None:
                    response.release()
                lease.release()
                raise
            if response is not None:
                response.release()
            lease.release()
            _note_failure(self.decode_pool, server, failure)
            lease = None
            if attempt + 1 < self.config.decode_attempts:
                lease = await self._next_decode_lease(plan, excluded)
        assert failure is not None
        raise failure

    def _stream(
        self,
        response: aiohttp.ClientResponse,
        lease: Lease,
        head: bytes,
        rest: AsyncIterator[bytes] | None,
    ) -> VllmStream:
        server = lease.server

        def failed(failure: BackendError) -> None:
            _note_failure(self.decode_pool, server, failure)

        return VllmStream(
            response, server.url, lease.release, head=head, rest=rest, on_failure=failed
        )
