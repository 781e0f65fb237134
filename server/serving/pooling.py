"""Embeddings and classification for every surface: per-item semantic caching in front of
the embedding and classification backends (one path for both).

A surface validates its own request and hands the core the model, the texts and the request
body in OpenAI's shape (what the exact key is built from); an embedding model served by a
generation backend (vLLM) takes the generation path instead."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson

from backends.interfaces import BackendError, UpstreamRejected, as_float32
from backends.local.classifier import TextClassifierBackend, label_names
from backends.registry import ModelInfo
from foundation.request import RequestContext
from semcache.entry import CachedAnswer
from semcache.semantic.items import ItemCache, label_margin
from server.errors import ApiError
from server.http.reply import Reply
from server.serving.cache_headers import (
    CacheDirectives,
    edge_headers,
    result_headers,
    semantic_headers,
)
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.usage_notes import note_result, note_semantic

Compute = Callable[[list[str]], Awaitable[tuple[list[bytes], list[int]]]]
"""Runs the backend on some texts: one stored payload and one token count per text."""


class Pooling:
    """The pooling core (see the module doc)."""

    def __init__(self, core: ServingCore, generation: Generation) -> None:
        self.core = core
        self.generation = generation

    def classifier_of(self, info: ModelInfo) -> TextClassifierBackend:
        """The classifier serving ``info``; a 400 when it is not a classification model."""
        if info.backend_name not in self.core.registry.classifiers:
            raise ApiError(
                400,
                f"The model `{info.id}` has no classifier on this gateway.",
                param="model",
                code="model_task_mismatch",
            )
        return self.core.registry.classifier_backend(info)

    async def embed(
        self,
        info: ModelInfo,
        texts: list[str],
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
        *,
        encoding_format: str = "float",
    ) -> Reply:
        """The embeddings of ``texts`` (a model's texts, token lists already decoded)."""
        backend = self.core.registry.embedding_backend(info)
        await backend.start()
        started = time.perf_counter()

        async def compute(todo: list[str]) -> tuple[list[bytes], list[int]]:
            self.core.metrics.count_backend_call(backend.name, "embeddings", len(todo))
            result = await backend.embed(todo)
            self.core.metrics.count_usage(info.id, {"prompt_tokens": sum(result.token_counts)})
            ctx.usage.add(sum(result.token_counts), 0)
            rows = as_float32(result.vectors)
            return [row.astype("<f4").tobytes() for row in rows], list(result.token_counts)

        def render(payloads: list[bytes], tokens: list[int]) -> bytes:
            return _embedding_body(info.id, payloads, tokens, encoding_format)

        async def count_tokens(todo: list[str]) -> list[int]:
            return backend.count_tokens(todo)

        reply = await self._pooled(
            "embeddings", info, body, ctx, directives, texts, compute, render, count_tokens
        )
        self.core.metrics.latency.labels("embeddings", "false").observe(
            time.perf_counter() - started
        )
        return reply

    async def classify(
        self,
        info: ModelInfo,
        texts: list[str],
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
    ) -> Reply:
        """The labels of ``texts`` on the embedded classifier or a vLLM classification model
        (``task = "classify"`` backend): one path, the same caches."""
        backend = self.classifier_of(info)
        if backend.uses_encoder:
            if self.core.semantic is None:
                raise ApiError(503, "The classifier is not available on this gateway.")
            await backend.start(await self.core.semantic.encoder())
        else:
            await backend.start()
        if backend.fixed_revision is None:
            self.core.registry.set_revision(info.backend_name, backend.version)
            refreshed = self.core.registry.resolve(info.id)
            info = refreshed if refreshed is not None else info
        started = time.perf_counter()
        ctx.salt_scope = self.core.scope(info, "classification", ctx)

        async def compute(todo: list[str]) -> tuple[list[bytes], list[int]]:
            self.core.metrics.count_backend_call(backend.name, "classification", len(todo))
            scored = await backend.classify(todo, ctx)
            tokens = await backend.count_tokens(todo)
            self.core.metrics.count_usage(info.id, {"prompt_tokens": sum(tokens)})
            ctx.usage.add(sum(tokens), 0)
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
                directives,
                texts,
                compute,
                render,
                backend.count_tokens,
                margin_of=margin,
            )
        except UpstreamRejected as exc:
            raise ApiError(exc.status, exc.message, code=exc.code) from None
        except BackendError as exc:
            self.core.metrics.backend_errors.labels(backend.name, exc.kind).inc()
            raise
        self.core.metrics.latency.labels("classification", "false").observe(
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
        ctx.usage.model, ctx.usage.route = info.id, route
        said: dict[str, str] = {}
        version = ""
        if self.core.guard is not None:  # the inputs as the content rules leave them
            policy = self.core.policy.current
            checked, said, inspection = await self.core.guard.begin(
                policy, info.id, route, {**body, "input": texts}, ctx
            )
            if inspection is not None:
                texts, version = list(checked["input"]), inspection.rule.version
                body = {**body, "input": texts}
        reply = await self._lookup(
            route,
            info,
            body,
            ctx,
            directives,
            texts,
            compute,
            render,
            count_tokens,
            margin_of=margin_of,
            guard_version=version,
        )
        reply.headers.update(said)
        return reply

    async def _lookup(
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
        margin_of: Callable[[bytes], float] | None,
        guard_version: str,
    ) -> Reply:
        creq = await self.core.cache_request(route, info, body, ctx, directives, guard_version)
        if creq is None:
            payloads, tokens = await compute(texts)
            return Reply(200, render(payloads, tokens))
        assert self.core.cache is not None
        use_items = self.core.semantic is not None and creq.rule.semantic.enabled and creq.cacheable
        tighten = directives.semantic_threshold if directives is not None else None
        outcome: dict[str, Any] = {}

        async def fill() -> CachedAnswer:
            if not use_items:
                computed, counted = await compute(texts)
                return CachedAnswer.from_json(render(computed, counted), model_id=info.id)
            assert self.core.cache is not None and self.core.semantic is not None
            items = ItemCache(self.core.cache, await self.core.semantic.get())
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
            outcome.update(
                served=len(served),
                similarity=look.min_similarity,
                saved=sum(tokens[i] for i in served),
            )
            return CachedAnswer.from_json(render(payloads, tokens), model_id=info.id)

        res = await self.core.cache.get_or_fill(creq, fill)
        assert res.entry is not None
        self.core.answered(ctx, creq, res, info, body)
        headers = result_headers(res, creq)
        note_result(ctx.usage, res)
        if outcome.get("served") and not res.from_cache and not res.coalesced:
            note_semantic(ctx.usage, outcome["served"], len(texts), outcome["saved"], 0)
            if ctx.usage.cache.hit:  # a partial answer is no hit (docs/cache.md)
                self.core.metrics.semantic_hits.labels(info.id, route).inc()
            if "semantic" not in creq.hidden:
                headers = semantic_headers(
                    outcome["served"],
                    len(texts),
                    outcome["similarity"],
                    creq.key.short_id,
                    stored=res.stored,
                    saved=None if "saved" in creq.hidden else (outcome["saved"], 0),
                    prices=creq.rule.prices,
                )
        headers.update(edge_headers(res, creq))
        return Reply(200, res.entry.body or b"", headers=headers)


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
