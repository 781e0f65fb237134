"""Exact hits answered before routing: byte-identical repeats of requests the cache holds.

Most of an exact hit's cost is finding its key: routing, parsing and validating the body,
canonicalising and hashing it. ``EarlyHits`` sits in front of Litestar's router
(``server.http.internals.before_routing``) and remembers, per API key and route, which key a
request body led to. A later request with the same bytes, no header that asks the cache
something (``DIRECTIVE_HEADERS``) and a fresh answer in the cache is answered here, through
the same ``Envelope.run`` as every routed request (admitted, accounted for, drained alike),
with the body and headers the route sends (the functions the routes use build them).
Everything else goes to the router, its body replayed and its record handed on, so the
request is authenticated once.

What a memo holds comes from the serving core itself: when it answers a request these hits
watch with a fresh exact hit, it tells them the request's ``CacheRequest`` (the key it built,
once) and model (``ServingCore.hits``). A memo holds only while what its key was built from
holds: the same rule object (a policy reload makes new ones), the same purge epochs (a purge
changes keys), the same model entry (a new revision replaces it). Non-stream answers go out
whole, streams as the route replays them (event by event); chat requests a semantic rule
applies to and bodies whose rule logs them always take the route.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from backends.registry import ModelInfo
from foundation import tracing as spans
from foundation.request import RequestContext
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheResult
from server.envelope.middleware import Envelope
from server.envelope.record import RECORD_KEY, RequestRecord
from server.envelope.server_span import run_traced
from server.errors import ApiError
from server.http.internals import encoded_headers
from server.http.reply import Reply
from server.http.respond import reply_headers
from server.identity.auth import model_allowed
from server.limits.limiter import estimate_tokens
from server.serving.cache_headers import DIRECTIVE_HEADERS, edge_headers, result_headers
from server.serving.cached_stream import replayed_reply
from server.serving.core import ServingCore
from server.serving.stream_format import stream_format
from server.serving.usage_notes import note_result
from server.surface import Watched

_DIRECTIVES: Final = frozenset(name.encode() for name in DIRECTIVE_HEADERS)

MemoKey = tuple[str, str, str, bytes]
"""(tenant, API key, path, body digest): per key, not per tenant, since a share group may
name some of a tenant's keys only."""


@dataclass(slots=True, eq=False)
class Memo:
    """What a request body led to, and what that held under."""

    creq: CacheRequest
    info: ModelInfo
    model: str
    """The model as the body names it (an id or an alias)."""
    stream: bool = False
    include_usage: bool = False
    """A stream's ``stream_options.include_usage``."""
    estimate: int = 1
    """The body's token estimate for the limits (``estimate_tokens``): the same bytes, so
    the same estimate every time."""
    headers: HeaderMemo | None = None
    """The last complete answer's encoded headers, reused while what they say holds
    (``HeaderMemo.of``)."""


@dataclass(frozen=True, slots=True)
class HeaderMemo:
    """A hit's encoded headers before and after its request id, and what they were made of:
    the entry, and every part of the cache's answer its headers read. Ages and lifetimes are
    whole seconds, so the same headers hold for up to a second of requests."""

    entry: CachedAnswer
    said: tuple[object, ...]
    before_id: list[tuple[bytes, bytes]]
    after_id: list[tuple[bytes, bytes]]

    @staticmethod
    def of(res: CacheResult, size: int) -> tuple[object, ...]:
        """What a hit's headers say of ``res`` and a body of ``size`` bytes."""
        entry = res.entry
        assert entry is not None
        age = res.age_s
        floor_ttl = math.floor(entry.ttl_s - age)
        return (res.status, int(age), floor_ttl, res.stored, res.from_cache, size)


def _plain_headers(
    raw: Iterable[tuple[bytes, bytes]], wanted: frozenset[bytes]
) -> dict[str, str] | None:
    """The ``wanted`` headers (the envelope's); ``None`` when a header asks the cache
    something."""
    out: dict[str, str] = {}
    for name, value in raw:
        low = name.lower()
        if low in _DIRECTIVES:
            return None
        if low in wanted:
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
    """The ASGI layer (see the module doc); ``size``: memos kept, the oldest dropped first.

    Built by the app factory: ``wrap`` puts it in front of the router, and the serving
    core tells it of the exact hits it answers (``exact_hit``)."""

    def __init__(
        self,
        core: ServingCore,
        envelope: Envelope,
        routes: Mapping[str, Watched],
        *,
        size: int = 10_000,
    ) -> None:
        self.core = core
        self.envelope = envelope
        self.size = size
        self.app: ASGIApp | None = None
        self.routes: dict[str, Watched] = dict(routes)
        """The paths watched: every surface's ``Surface.early_hits``."""
        self._memos: dict[MemoKey, Memo] = {}
        self._watching: dict[str, tuple[MemoKey, int]] = {}
        """Request id → the memo its route's exact hit would write, and its body's token
        estimate."""

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """This layer in front of ``app`` (the router)."""
        self.app = app
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if (
            route is None
            or scope["method"] != "POST"  # type: ignore[typeddict-item]
            or self.core.cache is None
            or self.envelope.drain.draining
        ):
            await self.app(scope, receive, send)
            return
        tracing = self.envelope.tracing
        if tracing is None:
            await self._handle(route, scope, receive, send)
        else:  # the trace starts here: the route's middleware joins it
            await run_traced(
                tracing, scope, scope["path"], lambda: self._handle(route, scope, receive, send)
            )

    async def _handle(self, route: Watched, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None
        headers = _plain_headers(scope["headers"], self.envelope.surfaces.wanted_headers)
        first = await receive()
        if (
            headers is None
            or first["type"] != "http.request"
            or first.get("more_body", False)
            or self.envelope.body_capture() is not None
        ):
            await self.app(scope, _replaying(first, receive), send)
            return
        path = scope["path"]
        try:
            with spans.span("auth"):
                record = self.envelope.open_record(
                    path, "token", headers, None, scope.get("query_string", b"")
                )
        except ApiError:  # the route answers it in its own format
            await self.app(scope, _replaying(first, receive), send)
            return
        principal = record.principal
        body: bytes = first.get("body", b"")
        digest = hashlib.blake2b(body, digest_size=32).digest()
        memo_key = (principal.tenant, principal.token_id, path, digest)
        memo = self._memos.get(memo_key)
        if memo is not None and await self._answer(memo, record, scope, first, receive, send):
            return
        # The route runs on this record (authenticated once) and tells what its hit was.
        scope["state"][RECORD_KEY] = record
        self._watching[record.request_id] = (memo_key, estimate_tokens(body))
        try:
            await self.app(scope, _replaying(first, receive), send)
        finally:
            self._watching.pop(record.request_id, None)

    def exact_hit(
        self, ctx: RequestContext, creq: CacheRequest, info: ModelInfo, body: Mapping[str, Any]
    ) -> None:
        """The serving core answered ``ctx``'s request with a fresh exact hit of ``creq``:
        a memo of it, when this layer watches that request and it may answer repeats."""
        watched = self._watching.pop(ctx.request_id, None)
        if watched is None or not creq.cacheable:
            return
        memo_key, estimate = watched
        name = self.routes[memo_key[2]].route
        model = body.get("model")
        stream = bool(body.get("stream"))
        if (
            creq.route != name
            or not isinstance(model, str)
            or (stream and name == "embeddings")
            or (name == "chat" and creq.rule.semantic.enabled)  # the semantic path may answer
        ):
            return
        if len(self._memos) >= self.size:
            del self._memos[next(iter(self._memos))]
        self._memos[memo_key] = Memo(
            creq=creq,
            info=info,
            model=model,
            stream=stream,
            include_usage=replay.wants_usage(body),
            estimate=estimate,
        )

    async def _valid(self, memo: Memo) -> bool:
        core = self.core
        assert core.cache is not None
        creq = memo.creq
        return (
            core.policy.current.rule(memo.info.id, creq.route) is creq.rule
            and core.registry.resolve(memo.model) is memo.info
            and await core.cache.epochs.snapshot() is creq.epochs
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
        cache = self.core.cache
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
        envelope = self.envelope
        admission = None
        receive = _replaying(first, receive)
        if envelope.limiter is not None:
            try:
                admission, receive = await envelope.admit(record, receive, memo.estimate)
            except ApiError:  # a refusal counts nothing: the route refuses it again, in form
                return False
        cache.count(creq, res, started)
        usage = record.usage
        usage.model, usage.route = memo.info.id, creq.route
        note_result(usage, res)
        drain = envelope.drain
        drain.enter()
        try:  # no body capture: a request whose bodies a rule may log takes the route
            await envelope.run(
                record, admission, scope, receive, send, self._sender(memo, res, record, started)
            )
        finally:
            drain.leave()
        return True

    def _sender(
        self, memo: Memo, res: CacheResult, record: RequestRecord, started: float
    ) -> ASGIApp:
        """The ASGI answer of a hit: the headers and bytes its route would send."""
        creq, entry = memo.creq, res.entry
        assert entry is not None
        metrics = self.core.metrics
        render = self.routes[record.route].render

        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            encoded: list[tuple[bytes, bytes]] | None
            if render is None and not memo.stream:
                reply = Reply(200, replay.as_json(entry, creq.route))
                encoded = self._json_headers(memo, res, record.request_id, len(reply.body))
            else:
                if render is not None:
                    reply = render(entry, res, creq, memo.stream)
                    size = None if reply.stream is not None else len(reply.body)
                else:
                    form = stream_format(creq.route)
                    reply = replayed_reply(entry, res, creq, memo.include_usage, form)
                    size = None
                encoded = encoded_headers(
                    reply_headers(reply, record.request_id), reply.media_type, "utf-8", size
                )
                assert encoded is not None  # hit headers never set the content type or length
            if not memo.stream:  # the route times complete answers only
                metrics.latency.labels(creq.route, "false").observe(time.perf_counter() - started)
            metrics.early_hits.labels(creq.route).inc()
            start: Message = {"type": "http.response.start", "status": 200, "headers": encoded}
            await send(start)
            if reply.stream is None:
                await send({"type": "http.response.body", "body": reply.body, "more_body": False})
                return
            async for chunk in reply.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return answer

    @staticmethod
    def _json_headers(
        memo: Memo, res: CacheResult, request_id: str, size: int
    ) -> list[tuple[bytes, bytes]]:
        """The encoded headers of an OpenAI JSON hit: the cache's, the request id, the
        content type and length; the memo's when they still say the same."""
        entry = res.entry
        assert entry is not None
        said = HeaderMemo.of(res, size)
        kept = memo.headers
        if kept is None or kept.entry is not entry or kept.said != said:
            creq = memo.creq
            hit = {**result_headers(res, creq), **edge_headers(res, creq)}
            headers = reply_headers(Reply(200, b"", headers=hit), None)
            encoded = encoded_headers(headers, None, "utf-8", size)
            assert encoded is not None  # hit headers never set the content type or length
            kept = HeaderMemo(entry, said, encoded[:-2], encoded[-2:])
            memo.headers = kept
        return [*kept.before_id, (b"x-request-id", request_id.encode("latin-1")), *kept.after_id]
