"""The serving object behind the OpenAI routes: validate, resolve the model, call the backend.

Routes stay thin: they read the body and hand it here; this module returns a `Reply` that
the route turns into a Litestar response. Answers of vLLM pass through byte for byte.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import orjson

from backends.classifier import label_names
from backends.protocol import (
    BackendError,
    GenerationBackend,
    RequestContext,
    UpstreamRejected,
    UpstreamStream,
    as_float32,
)
from backends.registry import ModelInfo, ModelRegistry, Task
from semcache import replay
from semcache.entry import CachedAnswer, StreamRecorder
from semcache.exact import CacheRequest, CacheResult, CacheStatus, ExactCache, Flight
from semcache.policy import PolicyHolder
from semcache.semantic.chat import chat_partition, chat_query, with_query
from semcache.semantic.items import ItemCache, label_margin
from semcache.semantic.service import SemanticService
from server.caching import CacheDirectives, result_headers, semantic_headers, status_headers
from server.errors import ApiError
from server.metrics import GatewayMetrics
from server.schemas.openai import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    InputError,
    classification_inputs,
    embedding_inputs,
)
from semcache.sse import DONE, SSEReader, error_event, event

SSE = "text/event-stream"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class GenerationCall:
    """One generation request on its way to a backend."""

    path: str
    route: str
    info: ModelInfo
    backend: GenerationBackend
    upstream: dict[str, Any]
    """The body sent to the backend: the client's, with ``model`` set to the served name."""
    ctx: RequestContext
    started: float


def broken_stream_event(message: str | None) -> bytes:
    text = (
        f"The backend failed mid-answer: {message}"
        if message
        else ("The backend ended the answer early.")
    )
    return error_event(text, code="backend_stream_broken")


@dataclass
class Reply:
    """What a route sends back: a complete body or a byte stream."""

    status: int
    body: bytes = b""
    stream: AsyncIterable[bytes] | None = None
    media_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON request body; anything but a JSON object is a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(
            400,
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


async def _refusal(up: UpstreamStream) -> CachedAnswer | None:
    """vLLM's answer when it refused to stream (any status but 200), else ``None``."""
    if up.status == 200:
        return None
    return CachedAnswer.from_json(await up.read_all(), status=up.status)


async def _replayed(payloads: list[bytes]) -> AsyncIterator[bytes]:
    for payload in payloads:
        yield event(payload)
    yield event(DONE)


class OpenAIServing:
    """Implements the /v1 routes: chat, completions, embeddings, classify and models."""

    def __init__(
        self,
        registry: ModelRegistry,
        metrics: GatewayMetrics,
        policy: PolicyHolder,
        cache: ExactCache | None = None,
        semantic: SemanticService | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.policy = policy
        self.cache = cache
        """Set at start-up (opening the tiers is async); ``None`` serves without caching."""
        self.semantic = semantic
        """The semantic cache (loaded on first use); also the classifier's encoder."""
        self._background: set[asyncio.Task[None]] = set()

    # -- models -----------------------------------------------------------------

    def model_card(self, info: ModelInfo) -> dict[str, Any]:
        return {
            "id": info.id,
            "object": "model",
            "created": info.created,
            "owned_by": info.owned_by,
            "task": info.task,
            "aliases": list(info.aliases),
            "revision": info.revision,
        }

    def list_models(self) -> Reply:
        data = [self.model_card(m) for m in self.registry.models.values()]
        return Reply(200, orjson.dumps({"object": "list", "data": data}))

    def get_model(self, name: str) -> Reply:
        info = self.registry.resolve(name)
        if info is None:
            raise self._unknown_model(name)
        return Reply(200, orjson.dumps(self.model_card(info)))

    @staticmethod
    def _unknown_model(name: str) -> ApiError:
        return ApiError(
            404,
            f"The model `{name}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )

    def resolve(self, name: str, task: Task) -> ModelInfo:
        info = self.registry.resolve(name)
        if info is None:
            raise self._unknown_model(name)
        if info.task != task:
            raise ApiError(
                400,
                f"The model `{name}` serves {info.task}, not {task}.",
                param="model",
                code="model_task_mismatch",
            )
        return info

    # -- generation ---------------------------------------------------------------

    async def chat(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, ChatCompletionRequest)
        info = self.resolve(req.model, "chat")
        return await self._generate(
            "/v1/chat/completions", "chat", info, body, bool(req.stream), ctx, cache
        )

    async def completions(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, CompletionRequest)
        info = self.resolve(req.model, "chat")
        return await self._generate(
            "/v1/completions", "completions", info, body, bool(req.stream), ctx, cache
        )

    async def _prepare(
        self,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None,
    ) -> CacheRequest | None:
        if self.cache is None or directives is None:
            return None
        return await self.cache.prepare(
            route=route,
            body=body,
            model_id=info.id,
            revision=info.revision,
            rule=self.policy.current.rule(info.id, route),
            tenant=ctx.tenant,
            control=directives.control,
            tags=directives.tags,
            chat_template_fp=info.chat_template_fp,
            custom_key=directives.custom_key,
        )

    async def _generate(
        self,
        path: str,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        stream: bool,
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
    ) -> Reply:
        backend = self.registry.generation_backend(info)
        shared = self.policy.current.rule(info.id, route).shared
        ctx.salt_scope = "shared" if shared else ctx.tenant
        call = GenerationCall(
            path=path,
            route=route,
            info=info,
            backend=backend,
            upstream={**body, "model": backend.served_model},
            ctx=ctx,
            started=time.perf_counter(),
        )
        creq = await self._prepare(route, info, body, ctx, directives)
        if creq is None:
            return await self._forward(call, stream)
        hit, remember = await self._chat_semantic(call, creq, body, stream, directives)
        if hit is not None:
            return hit
        if remember is not None:
            # The semantic record written after the store points to this answer: no record
            # may outlive its answer on disk after a crash.
            creq = msgspec.structs.replace(creq, write_through=True)
        if not stream:
            return await self._cached_json(call, creq, remember)
        return await self._cached_stream(call, creq, remember)

    async def _chat_semantic(
        self,
        call: GenerationCall,
        creq: CacheRequest,
        body: dict[str, Any],
        stream: bool,
        directives: CacheDirectives | None,
    ) -> tuple[Reply | None, Remember | None]:
        """A semantic hit for a qualifying chat request, or how to index its answer later.

        Opt-in per model in the policy; temperature 0, single-turn requests only (see
        ``semcache.semantic.chat``). The matched request's answer is looked up under its own
        exact key, so purges and expiry apply.
        """
        rule = creq.rule.semantic
        if (
            call.route != "chat"
            or not rule.enabled
            or self.semantic is None
            or self.cache is None
            or not creq.cacheable
            or (directives is not None and directives.custom_key is not None)
        ):
            return None, None
        query = chat_query(body)
        if query is None:
            return None, None
        index, text = query
        semantic = await self.semantic.get()
        partition = chat_partition(semantic, creq.key, body, index)
        vectors = await semantic.encode([text])
        control = creq.control
        ttl = control.ttl_s if control.ttl_s is not None else creq.rule.ttl_s
        ttl = max(0, min(ttl, creq.rule.max_ttl_s))

        async def remember() -> None:
            await semantic.insert(
                partition, [text], [creq.key.digest], float(ttl), rule=rule, vectors=vectors
            )

        if control.bypass_read:
            return None, remember
        tighten = directives.semantic_threshold if directives is not None else None
        (match,) = await semantic.lookup(partition, [text], rule, tighten, vectors=vectors)
        if match is None or match.text == text:
            return None, remember  # an identical text is the exact cache's job
        other = await self._prepare(
            call.route, call.info, with_query(body, index, match.text), call.ctx, directives
        )
        assert other is not None
        res = await self.cache.lookup(other)
        entry = res.entry
        if not res.from_cache or entry is None or entry.status != 200:
            await semantic.remove(partition, [match.payload_ref])
            return None, remember
        headers = semantic_headers(1, 1, match.similarity, creq.key.short_id, stored=False)
        if match.verifier_prob is not None:
            headers["x-semcache-verifier-prob"] = f"{match.verifier_prob:.4f}"
        self._observe_latency(call, stream=stream)
        if not stream:
            return Reply(200, replay.as_json(entry, call.route), headers=headers), None
        include_usage = replay.wants_usage(call.upstream)
        payloads = replay.as_stream(entry, call.route, include_usage=include_usage)
        return (
            Reply(
                200,
                stream=_replayed(payloads),
                media_type=SSE,
                headers={**SSE_HEADERS, **headers},
            ),
            None,
        )

    def _backend_failed(self, call: GenerationCall, kind: str) -> None:
        self.metrics.backend_errors.labels(call.backend.name, kind).inc()

    async def _forward(self, call: GenerationCall, stream: bool) -> Reply:
        """No cache: relay the backend's bytes as they are."""
        try:
            if not stream:
                resp = await call.backend.post(call.path, call.upstream, call.ctx)
                self._observe_latency(call, stream=False)
                if resp.status == 200:
                    self._count_usage(call.info, resp.body)
                return Reply(resp.status, resp.body, media_type=resp.content_type)
            opened = await call.backend.open_stream(call.path, call.upstream, call.ctx)
        except BackendError as exc:
            self._backend_failed(call, exc.kind)
            raise
        if opened.status != 200:
            # vLLM rejected the request before streaming (e.g. prompt too long): relay its error.
            return Reply(opened.status, await opened.read_all())
        return Reply(200, stream=self._relay(call, opened), media_type=SSE, headers=SSE_HEADERS)

    def _observe_latency(self, call: GenerationCall, *, stream: bool) -> None:
        elapsed = time.perf_counter() - call.started
        self.metrics.latency.labels(call.route, "true" if stream else "false").observe(elapsed)

    def _observe_ttft(self, call: GenerationCall) -> None:
        self.metrics.ttft.labels(call.route).observe(time.perf_counter() - call.started)

    async def _relay(self, call: GenerationCall, upstream: UpstreamStream) -> AsyncIterator[bytes]:
        """Relay chunks as they arrive; a broken upstream ends the stream with an error event."""
        reader = SSEReader()
        first = True
        try:
            async for chunk in upstream.chunks():
                if first:
                    self._observe_ttft(call)
                    first = False
                reader.feed(chunk)
                yield chunk
        except BackendError as exc:
            self._backend_failed(call, exc.kind)
            yield broken_stream_event(exc.message)
            return
        finally:
            await upstream.aclose()
        if not reader.done:
            self._backend_failed(call, "broken")
            yield broken_stream_event(None)
            return
        self._observe_latency(call, stream=True)
        self.metrics.count_usage(call.info.id, reader.usage())

    async def _cached_json(
        self, call: GenerationCall, creq: CacheRequest, remember: Remember | None = None
    ) -> Reply:
        assert self.cache is not None

        async def fill() -> CachedAnswer:
            try:
                resp = await call.backend.post(call.path, call.upstream, call.ctx)
            except BackendError as exc:
                self._backend_failed(call, exc.kind)
                raise
            # a non-200 answer is handed to coalesced waiters but never stored
            answer = CachedAnswer.from_json(
                resp.body, model_id=call.info.id, status=resp.status, content_type=resp.content_type
            )
            if resp.status == 200:  # the body is parsed once, for the answer's usage
                usage = answer.usage
                self.metrics.count_tokens(
                    call.info.id, usage.prompt_tokens, usage.completion_tokens
                )
            return answer

        res = await self.cache.get_or_fill(creq, fill)
        entry = res.entry
        assert entry is not None  # fill always answers (or raises)
        if res.stored and remember is not None:
            await remember()
        self._observe_latency(call, stream=False)
        headers = result_headers(res, creq.rule.prices) if entry.status == 200 else {}
        return Reply(entry.status, replay.as_json(entry, call.route), headers=headers)

    async def _cached_stream(
        self, call: GenerationCall, creq: CacheRequest, remember: Remember | None = None
    ) -> Reply:
        """A stream through the cache: replay a stored answer, or relay and record a live one.

        The backend is always asked for the usage chunk (so the stored answer knows its
        tokens); a client that did not ask for it does not get it. A miss is led from the
        request's own task: it opens the backend's stream at once (no hop through another
        task, so concurrent requests reach vLLM as each is handled), its response relays the
        stream, recording it, and the recorded answer ends the cache's flight.
        """
        assert self.cache is not None
        include_usage = replay.wants_usage(call.upstream)
        options = dict(call.upstream.get("stream_options") or {})
        live_body = {**call.upstream, "stream_options": {**options, "include_usage": True}}

        async def refresh() -> CachedAnswer | None:
            # stale-while-revalidate, in the background: no response relays it
            up = await self._open_stream(call, live_body)
            refused = await _refusal(up)
            return refused if refused is not None else await self._record(call, up)

        got = await self.cache.claim(creq, refresh)
        if isinstance(got, CacheResult):
            return self._replayed_reply(call, creq, got, include_usage)
        flight = got
        try:
            up = await self._open_stream(call, live_body)
            refused = await _refusal(up)
        except BaseException as exc:
            flight.fail(exc)
            raise
        if refused is not None:  # handed to coalesced waiters, never stored
            await flight.finish(refused)
            return Reply(refused.status, refused.body or b"")
        live = _LiveAnswer(up, asyncio.get_running_loop().create_future())
        self._land_when_recorded(flight, live, remember)
        status = CacheStatus.BYPASS if creq.control.bypass_read else CacheStatus.MISS
        headers = {**SSE_HEADERS, **status_headers(status, creq.key.short_id)}
        relay = ClosingStream(self._live(call, live, include_usage), live.abandon)
        return Reply(200, stream=relay, media_type=SSE, headers=headers)

    async def _open_stream(self, call: GenerationCall, body: dict[str, Any]) -> UpstreamStream:
        try:
            return await call.backend.open_stream(call.path, body, call.ctx)
        except BackendError as exc:
            self._backend_failed(call, exc.kind)
            raise

    def _replayed_reply(
        self, call: GenerationCall, creq: CacheRequest, res: CacheResult, include_usage: bool
    ) -> Reply:
        """A stream answered by the cache: a hit, or another request's (coalesced) answer."""
        entry = res.entry
        if entry is None:
            raise BackendError("broken", "the backend gave no complete answer")
        if entry.status != 200:
            return Reply(entry.status, entry.body or b"")
        payloads = replay.as_stream(entry, call.route, include_usage=include_usage)
        headers = {**SSE_HEADERS, **result_headers(res, creq.rule.prices)}
        return Reply(200, stream=_replayed(payloads), media_type=SSE, headers=headers)

    def _land_when_recorded(
        self, flight: Flight, live: _LiveAnswer, remember: Remember | None
    ) -> None:
        """End the flight with what the relay recorded (``None``: nothing is stored), in the
        background; then index a stored answer in the semantic cache."""

        async def land() -> None:
            try:
                answer = await live.recorded
            except asyncio.CancelledError as exc:  # the gateway is shutting down
                flight.fail(exc)
                raise
            res = await flight.finish(answer)
            if res.stored and remember is not None:
                await remember()

        self._keep(asyncio.create_task(land()))

    async def _record(self, call: GenerationCall, up: UpstreamStream) -> CachedAnswer | None:
        """Read and record a whole stream that no response relays (a background refresh)."""
        reader, recorder = SSEReader(), StreamRecorder(call.info.id)
        try:
            async for chunk in up.chunks():
                for payload in reader.feed(chunk):
                    recorder.feed(payload)
        except BackendError as exc:
            self._backend_failed(call, exc.kind)
            return None
        finally:
            await up.aclose()
        self.metrics.count_usage(call.info.id, reader.usage())
        return recorder.answer()  # None unless complete: nothing partial is stored

    async def _live(
        self, call: GenerationCall, live: _LiveAnswer, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        """Relay the leader's live answer as it arrives, recording it for the cache.

        The events of one backend chunk go out together. The recorded answer (``None`` unless
        complete) goes to the cache's fill once the backend's stream has ended, before the
        last events are relayed; a client gone earlier leaves it ``None`` (nothing stored).
        """
        up = live.upstream
        reader, recorder = SSEReader(), StreamRecorder(call.info.id)
        first = True
        done = False
        held = b""  # the events from [DONE] on, sent once the backend's stream has ended
        try:
            try:
                async for chunk in up.chunks():
                    out = []
                    for payload in reader.feed(chunk):
                        recorder.feed(payload)
                        if first:
                            self._observe_ttft(call)
                            first = False
                        if payload == DONE:
                            done = True
                        elif not include_usage and replay.is_usage_only(payload):
                            continue
                        out.append(event(payload))
                    if not out:
                        continue
                    if done:
                        held += b"".join(out)
                    else:
                        yield out[0] if len(out) == 1 else b"".join(out)
            except BackendError as exc:
                self._backend_failed(call, exc.kind)
                live.settle(None)
                if held:
                    yield held
                yield broken_stream_event(exc.message)
                return
            self.metrics.count_usage(call.info.id, reader.usage())
            live.settle(recorder.answer())  # None unless complete: nothing partial is stored
            if held:
                yield held
            if not done:
                yield broken_stream_event(None)
                return
            self._observe_latency(call, stream=True)
        finally:
            # The client has gone unless settled: store nothing; abort an unfinished backend.
            await live.abandon()

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold a background task until it is done (the loop keeps only weak references)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _count_usage(self, info: ModelInfo, body: bytes) -> None:
        try:
            usage = orjson.loads(body).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return
        self.metrics.count_usage(info.id, usage if isinstance(usage, dict) else None)

    # -- embeddings and classification (per-item semantic caching) ----------------

    async def embeddings(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, EmbeddingRequest)
        info = self.resolve(req.model, "embeddings")
        if info.backend_name in self.registry.generation:
            return await self._generate(
                "/v1/embeddings", "embeddings", info, body, False, ctx, cache
            )
        backend = self.registry.embedding_backend(info)
        try:
            items = embedding_inputs(req.input)
        except InputError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        await backend.start()
        if req.dimensions is not None and req.dimensions != backend.dimensions:
            raise ApiError(
                400,
                f"The model `{info.id}` only supports dimensions={backend.dimensions}.",
                param="dimensions",
                code="invalid_value",
            )
        started = time.perf_counter()
        texts = [t if isinstance(t, str) else backend.detokenize(t) for t in items]

        async def compute(todo: list[str]) -> tuple[list[bytes], list[int]]:
            result = await backend.embed(todo)
            self.metrics.count_usage(info.id, {"prompt_tokens": sum(result.token_counts)})
            rows = as_float32(result.vectors)
            return [row.astype("<f4").tobytes() for row in rows], list(result.token_counts)

        def render(payloads: list[bytes], tokens: list[int]) -> bytes:
            return _embedding_body(info.id, payloads, tokens, req.encoding_format)

        async def count_tokens(todo: list[str]) -> list[int]:
            return backend.count_tokens(todo)

        reply = await self._pooled(
            "embeddings", info, body, ctx, cache, texts, compute, render, count_tokens
        )
        self.metrics.latency.labels("embeddings", "false").observe(time.perf_counter() - started)
        return reply

    async def classify(
        self, body: dict[str, Any], ctx: RequestContext, cache: CacheDirectives | None = None
    ) -> Reply:
        """``POST /v1/classify`` in vLLM's shape, on the embedded classifier or a vLLM
        classification model (``task = "classify"`` backend): one path, the same caches."""
        req = msgspec.convert(body, ClassificationRequest)
        info = self.resolve(req.model, "classification")
        if info.backend_name not in self.registry.classifiers:
            raise ApiError(
                400,
                f"The model `{info.id}` has no classifier on this gateway.",
                param="model",
                code="model_task_mismatch",
            )
        try:
            texts = classification_inputs(req.input)
        except InputError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        backend = self.registry.classifier_backend(info)
        if backend.uses_encoder:
            if self.semantic is None:
                raise ApiError(503, "The classifier is not available on this gateway.")
            await backend.start(await self.semantic.encoder())
        else:
            await backend.start()
        if backend.fixed_revision is None:
            self.registry.set_revision(info.backend_name, backend.version)
            info = self.resolve(req.model, "classification")
        started = time.perf_counter()
        ctx.salt_scope = (
            "shared" if self.policy.current.rule(info.id, "classification").shared else ctx.tenant
        )

        async def compute(todo: list[str]) -> tuple[list[bytes], list[int]]:
            scored = await backend.classify(todo, ctx)
            tokens = await backend.count_tokens(todo)
            self.metrics.count_usage(info.id, {"prompt_tokens": sum(tokens)})
            labels = backend.labels
            payloads = [
                orjson.dumps([dict(row).get(label, 0.0) for label in labels]) for row in scored
            ]
            return payloads, tokens

        def render(payloads: list[bytes], tokens: list[int]) -> bytes:
            return _classification_body(info.id, backend.labels, payloads, tokens)

        def margin(payload: bytes) -> float:
            return label_margin(orjson.loads(payload))

        try:
            reply = await self._pooled(
                "classification",
                info,
                body,
                ctx,
                cache,
                texts,
                compute,
                render,
                backend.count_tokens,
                margin_of=margin,
            )
        except UpstreamRejected as exc:
            raise ApiError(exc.status, exc.message, code=exc.code) from None
        except BackendError as exc:
            self.metrics.backend_errors.labels(backend.name, exc.kind).inc()
            raise
        self.metrics.latency.labels("classification", "false").observe(
            time.perf_counter() - started
        )
        return reply

    async def _pooled(
        self,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None,
        texts: list[str],
        compute: Compute,
        render: Callable[[list[bytes], list[int]], bytes],
        count_tokens: Callable[[list[str]], Awaitable[list[int]]],
        *,
        margin_of: Callable[[bytes], float] | None = None,
    ) -> Reply:
        """Exact key first; on a miss, per-item semantic lookups, the backend for the rest.

        ``compute`` runs the backend on some texts and returns one payload (the item's
        stored answer) and token count per text; ``render`` builds the response body.
        ``margin_of`` (classification) reads a stored answer's label margin: a match whose
        margin is under the rule's ``min_label_margin`` is treated as a miss.
        """
        creq = await self._prepare(route, info, body, ctx, directives)
        if creq is None:
            payloads, tokens = await compute(texts)
            return Reply(200, render(payloads, tokens))
        assert self.cache is not None
        use_items = self.semantic is not None and creq.rule.semantic.enabled and creq.cacheable
        tighten = directives.semantic_threshold if directives is not None else None
        outcome: dict[str, Any] = {}

        async def fill() -> CachedAnswer:
            if not use_items:
                computed, counted = await compute(texts)
                return CachedAnswer.from_json(render(computed, counted), model_id=info.id)
            assert self.cache is not None and self.semantic is not None
            items = ItemCache(self.cache, await self.semantic.get())
            look = await items.lookup(creq, texts, tighten_threshold=tighten)
            floor = creq.rule.semantic.min_label_margin
            if margin_of is not None and floor > 0:
                look.hits = [
                    hit if hit is not None and margin_of(hit.payload) >= floor else None
                    for hit in look.hits
                ]
            misses = look.miss_indices
            payloads: list[bytes] = [b""] * len(texts)
            tokens: list[int] = [0] * len(texts)
            if misses:
                todo = [texts[i] for i in misses]
                got, counts = await compute(todo)
                for n, i in enumerate(misses):
                    payloads[i], tokens[i] = got[n], counts[n]
                await items.store(creq, look, todo, got, counts, misses)
            served = [i for i, hit in enumerate(look.hits) if hit is not None]
            if served:
                # Usage counts the request's own texts, as the backend would have.
                counts = await count_tokens([texts[i] for i in served])
                for n, i in enumerate(served):
                    hit = look.hits[i]
                    assert hit is not None
                    payloads[i], tokens[i] = hit.payload, counts[n]
            outcome.update(served=len(served), similarity=look.min_similarity)
            return CachedAnswer.from_json(render(payloads, tokens), model_id=info.id)

        res = await self.cache.get_or_fill(creq, fill)
        assert res.entry is not None
        headers = result_headers(res, creq.rule.prices)
        if outcome.get("served") and not res.from_cache and not res.coalesced:
            headers = semantic_headers(
                outcome["served"],
                len(texts),
                outcome["similarity"],
                creq.key.short_id,
                stored=res.stored,
            )
        return Reply(200, res.entry.body or b"", headers=headers)


class _LiveAnswer:
    """A leader's open backend stream and the future its relay settles with the recorded
    answer (``None``: incomplete, or the client left), which the cache's fill returns."""

    __slots__ = ("recorded", "upstream")

    def __init__(
        self, upstream: UpstreamStream, recorded: asyncio.Future[CachedAnswer | None]
    ) -> None:
        self.upstream = upstream
        self.recorded = recorded

    def settle(self, answer: CachedAnswer | None) -> None:
        if not self.recorded.done():
            self.recorded.set_result(answer)

    async def abandon(self) -> None:
        """The response is over: store nothing unless settled, release the backend's stream."""
        self.settle(None)
        await self.upstream.aclose()


class ClosingStream:
    """A response stream whose ``aclose`` closes the generator, then runs ``on_close``: for
    what must be released even when the generator never started (closing an unstarted
    generator runs none of its code)."""

    def __init__(
        self, stream: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self._stream = stream
        self._on_close = on_close

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            await self._on_close()


async def aclose_stream(stream: AsyncIterable[bytes]) -> None:
    """Close a response stream (a generator or a :class:`ClosingStream`), if it can be."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


Remember = Callable[[], Awaitable[None]]
"""Adds a stored chat answer to the semantic index."""

Compute = Callable[[list[str]], Awaitable[tuple[list[bytes], list[int]]]]


def _usage(tokens: list[int]) -> dict[str, int]:
    total = sum(tokens)
    return {"prompt_tokens": total, "total_tokens": total}


def _embedding_body(
    model_id: str, payloads: list[bytes], tokens: list[int], encoding: str
) -> bytes:
    data: list[dict[str, Any]] = []
    for i, payload in enumerate(payloads):
        vec: Any
        if encoding == "base64":
            vec = base64.b64encode(payload).decode("ascii")
        else:
            vec = np.frombuffer(payload, dtype="<f4")
        data.append({"object": "embedding", "index": i, "embedding": vec})
    out = {"object": "list", "data": data, "model": model_id, "usage": _usage(tokens)}
    return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


def _classification_body(
    model_id: str, labels: list[str], payloads: list[bytes], tokens: list[int]
) -> bytes:
    data: list[dict[str, Any]] = []
    for i, payload in enumerate(payloads):
        probs = orjson.loads(payload)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(
            {
                "index": i,
                "label": label_names(labels, len(probs))[best],
                "probs": probs,
                "num_classes": len(probs),
                "object": "classification",
            }
        )
    out = {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model_id,
        "data": data,
        "usage": {**_usage(tokens), "completion_tokens": 0, "prompt_tokens_details": None},
    }
    return orjson.dumps(out)
