"""Exact hits answered before routing: byte-identical repeats of requests the cache holds.

Most of an exact hit's cost is finding its key: routing, parsing and validating the body,
canonicalising and hashing it. ``EarlyHits`` sits in front of Litestar's router
(``server.http.internals.before_routing``) and remembers, per tenant and route, which key a
request body led to. A later request with the same bytes, no header that asks the cache
something (``DIRECTIVE_HEADERS``) and a fresh answer in the cache is answered here:
authenticated, admitted and accounted for by the same ``Tenancy`` as every request, with the
body and headers the route sends (the functions the routes use build them). Everything else
goes to the router untouched, its body replayed.

A memo holds only while what its key was built from holds: the same policy snapshot, the same
purge epochs (a purge changes keys), the same model entry (a new revision replaces it). It is
written after the route itself answered those bytes with an exact hit (so a request never
repeated costs nothing more), and only when the key computed here equals the one that answer
carried (``x-semcache-key``).
Non-stream answers go out whole, streams as the route replays them (event by event); chat
requests a semantic rule applies to and bodies whose rule logs them always take the route.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from backends.registry import ModelInfo, Task
from foundation import tracing as spans
from foundation.request import RequestContext
from semcache import replay
from semcache.exact import CacheRequest
from semcache.policy import Policy
from server.envelope.middleware import WANTED_HEADERS, Tenancy
from server.envelope.record import RECORD_KEY, RequestRecord
from server.envelope.server_span import run_traced
from server.errors import ApiError
from server.http.draining import Drain
from server.http.internals import encoded_headers
from server.http.reply import Reply
from server.http.respond import reply_headers
from server.identity.auth import model_allowed
from server.limits.limiter import Admission
from server.serving.cache_headers import (
    DIRECTIVE_HEADERS,
    CacheDirectives,
    edge_headers,
    result_headers,
)
from server.serving.cached_stream import replayed_reply
from server.serving.core import ServingCore
from server.serving.stream_format import stream_format
from server.serving.usage_notes import note_result

ROUTES: Final[dict[str, tuple[str, Task]]] = {
    "/v1/chat/completions": ("chat", "chat"),
    "/v1/completions": ("completions", "chat"),
    "/v1/embeddings": ("embeddings", "embeddings"),
}
"""Path → (the cache's route name, the task its model serves)."""

_DIRECTIVES: Final = frozenset(name.encode() for name in DIRECTIVE_HEADERS)


@dataclass(frozen=True, slots=True)
class Memo:
    """What a request body led to, and what that held under."""

    creq: CacheRequest
    info: ModelInfo
    model: str
    """The model as the body names it (an id or an alias)."""
    policy: Policy
    stream: bool = False
    include_usage: bool = False
    """A stream's ``stream_options.include_usage``."""


def _plain_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The headers the tenancy layer reads; ``None`` when a header asks the cache something."""
    out: dict[str, str] = {}
    for name, value in raw:
        low = name.lower()
        if low in _DIRECTIVES:
            return None
        if low in WANTED_HEADERS:
            out[low.decode()] = value.decode("latin-1")
    return out


def _replaying(first: ReceiveMessage, receive: Receive) -> Receive:
    """``receive`` with ``first`` handed out again before the client's next messages."""
    pending: list[ReceiveMessage] = [first]

    async def replay_first() -> ReceiveMessage:
        if pending:
            return pending.pop()
        return await receive()

    return replay_first


class EarlyHits:
    """The ASGI layer (see the module doc); ``size``: memos kept, the oldest dropped first."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServingCore,
        tenancy: Tenancy,
        drain: Drain,
        *,
        size: int = 10_000,
    ) -> None:
        self.app = app
        self.state = state
        self.tenancy = tenancy
        self.drain = drain
        self.size = size
        self._memos: dict[tuple[str, str, str, bytes], Memo] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if (
            route is None
            or scope["method"] != "POST"  # type: ignore[typeddict-item]
            or self.state.cache is None
            or self.drain.draining
        ):
            await self.app(scope, receive, send)
            return
        tracing = self.tenancy.tracing
        if tracing is None:
            await self._handle(route, scope, receive, send)
        else:  # the trace starts here: the route's middleware joins it
            await run_traced(
                tracing, scope, scope["path"], lambda: self._handle(route, scope, receive, send)
            )

    async def _handle(
        self, route: tuple[str, Task], scope: Scope, receive: Receive, send: Send
    ) -> None:
        headers = _plain_headers(scope["headers"])
        first = await receive()
        if (
            headers is None
            or first["type"] != "http.request"
            or first.get("more_body", False)
            or self.tenancy.body_capture() is not None
        ):
            await self.app(scope, _replaying(first, receive), send)
            return
        path = scope["path"]
        body: bytes = first.get("body", b"")
        try:
            with spans.span("auth"):
                record = self.tenancy.open_record(path, "token", headers, None)
        except ApiError:  # the route answers it in its own format
            await self.app(scope, _replaying(first, receive), send)
            return
        principal = record.principal
        digest = hashlib.blake2b(body, digest_size=32).digest()
        # per key, not per tenant: a share group may name some of a tenant's keys only
        memo_key = (principal.tenant, principal.token_id, path, digest)
        memo = self._memos.get(memo_key)
        if memo is not None and await self._answer(memo, record, scope, first, receive, send):
            return
        await self._learn(memo_key, route, body, scope, _replaying(first, receive), send)

    async def _valid(self, memo: Memo) -> bool:
        state = self.state
        assert state.cache is not None
        return (
            state.policy.current is memo.policy
            and state.registry.resolve(memo.model) is memo.info
            and await state.cache.epochs.snapshot() is memo.creq.epochs
        )

    async def _answer(
        self,
        memo: Memo,
        record: RequestRecord,
        scope: Scope,
        first: ReceiveMessage,
        receive: Receive,
        send: Send,
    ) -> bool:
        """Send the cached answer as the route would; False (nothing sent or counted) when
        the memo no longer holds, the answer is not a fresh hit, or a limit refuses it."""
        cache = self.state.cache
        assert cache is not None
        started = time.perf_counter()
        if not model_allowed(record.principal.models, memo.model, memo.info):
            return False  # the route answers the 403
        if not await self._valid(memo):
            return False
        creq = memo.creq
        res = await cache.fresh_hit(creq)
        if res is None or res.entry is None:
            return False
        scope["state"][RECORD_KEY] = record  # the trace's server span reads it
        tenancy = self.tenancy
        admission: Admission | None = None
        extra: list[tuple[bytes, bytes]] = []
        if tenancy.limiter is not None:
            try:
                admission, _ = await tenancy.admit(record, _replaying(first, receive))
            except ApiError:  # a refusal counts nothing: the route refuses it again, in form
                return False
            extra = tenancy.limiter.encoded_headers(admission)
        cache.count(creq, res, started)
        self.drain.enter()
        try:
            usage = record.usage
            usage.model, usage.route = memo.info.id, creq.route
            note_result(usage, res)
            if memo.stream:
                form = stream_format(creq.route)
                reply = replayed_reply(res.entry, res, creq, memo.include_usage, form)
                size = None
            else:
                hit = {**result_headers(res, creq), **edge_headers(res, creq)}
                reply = Reply(200, replay.as_json(res.entry, creq.route), headers=hit)
                size = len(reply.body)
            encoded = encoded_headers(
                reply_headers(reply, record.request_id), reply.media_type, "utf-8", size
            )
            assert encoded is not None  # hit headers never set the content type or length
            metrics = self.state.metrics
            if not memo.stream:  # the route times complete answers only
                metrics.latency.labels(creq.route, "false").observe(time.perf_counter() - started)
            metrics.early_hits.labels(creq.route).inc()
            record.status = 200
            await send({"type": "http.response.start", "status": 200, "headers": encoded + extra})
            if reply.stream is None:
                record.ttft_s = time.perf_counter() - record.started
                await send({"type": "http.response.body", "body": reply.body, "more_body": False})
            else:
                async for chunk in reply.stream:
                    if record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - record.started
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            record.completed = True
        finally:
            record.latency_s = time.perf_counter() - record.started
            tenancy.finish(record)
            if admission is not None:
                await tenancy.settle(record, admission)
            self.drain.leave()
        return True

    async def _learn(
        self,
        memo_key: tuple[str, str, str, bytes],
        route: tuple[str, Task],
        body: bytes,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Let the route answer; remember the body's key when it answered with an exact hit."""
        start: dict[str, Any] = {}

        async def watching(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            await send(message)

        await self.app(scope, receive, watching)
        if start.get("status") != 200:
            return
        sent = dict(start.get("headers", ()))
        short_id = sent.get(b"x-semcache-key")
        if (
            short_id is None
            or sent.get(b"cf-aig-cache-status") != b"HIT"
            or b"semantic" in sent.get(b"cache-status", b"")
        ):
            return
        handler = scope.get("route_handler")
        if not isinstance(handler, HTTPRouteHandler) or self.tenancy.route_of(handler) != (
            scope["path"],
            "token",
        ):
            return
        memo = await self._memo_of(route, body, memo_key[0], memo_key[1])
        if memo is None or memo.creq.key.short_id.encode() != short_id:
            return
        if len(self._memos) >= self.size:
            del self._memos[next(iter(self._memos))]
        self._memos[memo_key] = memo

    async def _memo_of(
        self, route: tuple[str, Task], body: bytes, tenant: str, token: str
    ) -> Memo | None:
        """The key the route computed for ``body``, computed again as the route does."""
        state = self.state
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        model = parsed.get("model")
        info = state.registry.resolve(model) if isinstance(model, str) else None
        name, task = route
        stream = bool(parsed.get("stream"))
        if model is None or info is None or info.task != task or (stream and name == "embeddings"):
            return None
        policy = state.policy.current
        ctx = RequestContext(request_id="", tenant=tenant, token_id=token)
        creq = await state.cache_request(name, info, parsed, ctx, CacheDirectives())
        if creq is None or not creq.cacheable or state.policy.current is not policy:
            return None
        if name == "chat" and creq.rule.semantic.enabled:  # the semantic path may answer it
            return None
        return Memo(
            creq=creq,
            info=info,
            model=model,
            policy=policy,
            stream=stream,
            include_usage=replay.wants_usage(parsed),
        )
