"""``POST /client/v4/accounts/{account_id}/ai/run/{model}``: a model run, a batch submission
or a poll. Model runs, live or a batch's items, are translated to the serving core's
OpenAI-shaped requests (generation, pooling) and their answers back."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from backends.interfaces import BackendError
from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from foundation.sse import MEDIA_TYPE
from server.batch.results import ItemOutcome
from server.batch.service import BatchService
from server.batch.system import BatchSystem
from server.errors import ApiError, from_backend, from_validation
from server.http.reply import SSE_HEADERS, ClosingStream, Reply, aclose_stream
from server.identity.auth import check_model
from server.serving.cache_headers import CacheDirectives, reshaped
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.pooling import Pooling
from server.serving.scoring import Pair, Scoring
from server.workers_ai.protocol import (
    DEFAULT_MAX_TOKENS,
    ClassificationInput,
    EmbeddingInput,
    RerankInput,
    TextGenerationInput,
    envelope,
    error_object,
    input_schema,
    truthy,
)
from server.workers_ai.translate import (
    classification_result,
    embedding_request,
    embedding_result,
    rerank_result,
    text_request,
    text_result,
    upstream_error,
    workers_stream,
)


@dataclass
class Answer:
    """One model run's answer: the envelope's ``result`` and the cache's headers, or a
    streamed text answer."""

    result: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: Reply | None = None


class WorkersAIServing:
    """Implements ``POST /client/v4/accounts/{account_id}/ai/run/{model}``."""

    def __init__(
        self,
        core: ServingCore,
        generation: Generation,
        pooling: Pooling,
        batches: BatchSystem | None = None,
        scoring: Scoring | None = None,
    ) -> None:
        self.core = core
        self.registry: ModelRegistry = core.registry
        self.generation = generation
        self.pooling = pooling
        self.batches = batches
        self.scoring = scoring or Scoring(core)

    # -- entry points ---------------------------------------------------------------------

    async def run(
        self,
        model: str,
        body: dict[str, Any],
        ctx: RequestContext,
        *,
        queue_request: bool = False,
        directives: CacheDirectives | None = None,
    ) -> Reply:
        """One ``/ai/run/{model}`` request: a model run, a batch submission or a poll."""
        info = self.resolve(model)
        check_model(ctx.models, model, info)
        given = body.get("options")
        options: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        queued = (
            queue_request or truthy(body.get("queueRequest")) or truthy(options.get("queueRequest"))
        )
        tenant = ctx.tenant or "anonymous"
        if "request_id" in body and "requests" not in body:
            return Reply(200, envelope(await self._accepting().poll(tenant, body["request_id"])))
        if "requests" in body or queued:
            if not queued:
                raise ApiError(
                    400,
                    "`requests` is a batch: send it with `?queueRequest=true` "
                    '(or `"options": {"queueRequest": true}`).',
                    param="queueRequest",
                    code="invalid_value",
                )
            requests = body.get("requests")
            if isinstance(requests, list):
                for i, item in enumerate(requests):
                    if isinstance(item, dict):
                        self._validate_item(info, item, i)
            queued_result = await self._accepting().submit(tenant, model, requests)
            return Reply(200, envelope(queued_result))
        inputs = {k: v for k, v in body.items() if k not in ("options", "queueRequest")}
        # sync first: batch items running on the model's backend stop before this request is
        # sent (they go back to the queue)
        self.core.announce(info.backend_name, ctx)
        answer = await self._answer(
            info, inputs, ctx, directives or CacheDirectives(), may_stream=True
        )
        if answer.stream is not None:
            return answer.stream
        return Reply(200, envelope(answer.result), headers=reshaped(answer.headers))

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        """One item of a batch, through the same path (and caches) as a live request."""
        try:
            info = self.resolve(model)
            answer = await self._answer(info, body, ctx, CacheDirectives(), may_stream=False)
        except msgspec.ValidationError as exc:
            return ItemOutcome(success=False, errors=[error_object(from_validation(exc))])
        except BackendError as exc:
            err = from_backend(exc)
            return ItemOutcome(success=False, errors=[error_object(err)], retryable=True)
        except ApiError as exc:
            retryable = exc.status in (408, 429, 502, 503, 504)
            return ItemOutcome(success=False, errors=[error_object(exc)], retryable=retryable)
        result = answer.result
        usage = result.get("usage") if isinstance(result, dict) else None
        counts = {k: v for k, v in usage.items() if type(v) is int} if usage else None
        return ItemOutcome(success=True, result=result, usage=counts)

    # -- helpers -----------------------------------------------------------------------------

    def resolve(self, model: str) -> ModelInfo:
        info = self.registry.resolve(model)
        if info is None:
            raise ApiError(400, f"No such model {model} or task", code="model_not_found")
        return info

    def _accepting(self) -> BatchService:
        if self.batches is None:
            raise ApiError(
                400, "Queued requests are disabled on this gateway.", code="batch_disabled"
            )
        return self.batches.accepting()

    def _validate_item(self, info: ModelInfo, item: dict[str, Any], index: int) -> None:
        fields = {k: v for k, v in item.items() if k != "external_reference"}
        try:
            msgspec.convert(fields, input_schema(info.task))
        except msgspec.ValidationError as exc:
            err = from_validation(exc)
            where = f"requests[{index}]" + (f".{err.param}" if err.param else "")
            raise ApiError(
                400,
                err.message.replace(f"'{err.param}'", f"'{where}'"),
                param=where,
                code="invalid_value",
            ) from None

    async def _answer(
        self,
        info: ModelInfo,
        inputs: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives,
        *,
        may_stream: bool,
    ) -> Answer:
        """Run the model on ``inputs`` (checked against its task's schema); a text input
        with ``stream: true`` streams only when ``may_stream`` (a live request)."""
        inp = msgspec.convert(inputs, input_schema(info.task))
        if isinstance(inp, TextGenerationInput):
            if inp.stream and may_stream:
                return Answer(stream=await self._stream_text(info, inp, ctx, directives))
            return await self._text(info, inp, ctx, directives)
        if isinstance(inp, EmbeddingInput):
            return await self._embed(info, inp, ctx, directives)
        if isinstance(inp, RerankInput):
            return await self._rerank(info, inp, ctx, directives)
        assert isinstance(inp, ClassificationInput)
        return await self._classify(info, inp, ctx, directives)

    async def _call_text(
        self,
        info: ModelInfo,
        route: str,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Reply:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        stream = bool(body.get("stream"))
        # Workers AI's `max_tokens` is a ceiling: past the model's context the answer stops
        # where the context ends (the serving core lowers it), instead of being refused.
        return await self.generation.generate(
            path,
            route,
            info,
            body,
            stream,
            ctx,
            directives,
            max_tokens_fallback=DEFAULT_MAX_TOKENS,
            max_tokens_ceiling=True,
        )

    async def _text(
        self,
        info: ModelInfo,
        inp: TextGenerationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Answer:
        route, body = text_request(info, inp)
        reply = await self._call_text(info, route, body, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        return Answer(text_result(route, reply.body), reply.headers)

    async def _stream_text(
        self,
        info: ModelInfo,
        inp: TextGenerationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Reply:
        route, body = text_request(info, inp)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        reply = await self._call_text(info, route, body, ctx, directives)
        if reply.stream is None:
            if reply.status != 200:
                raise upstream_error(reply)
            raise ApiError(502, "The model did not stream its answer.", code="backend_error")
        headers = {**reply.headers, **SSE_HEADERS}
        return Reply(
            200,
            stream=ClosingStream(
                workers_stream(reply.stream), functools.partial(aclose_stream, reply.stream)
            ),
            media_type=MEDIA_TYPE,
            headers=headers,
        )

    async def _embed(
        self,
        info: ModelInfo,
        inp: EmbeddingInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Answer:
        body = embedding_request(info, inp)
        if info.backend_name in self.registry.generation:  # a vLLM embedding model
            generate = self.generation.generate
            reply = await generate(
                "/v1/embeddings", "embeddings", info, body, False, ctx, directives
            )
        else:
            reply = await self.pooling.embed(info, body["input"], body, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        return Answer(embedding_result(reply.body), reply.headers)

    async def _rerank(
        self,
        info: ModelInfo,
        inp: RerankInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Answer:
        """Through the scoring core: the same per-pair cache as ``/v1/rerank``."""
        pairs = [(inp.query, c.text) for c in inp.contexts]
        body = {"model": info.id, **msgspec.to_builtins(inp), "endpoint": "workers-ai"}

        def render(scores: list[float], tokens: list[int], _: Sequence[Pair]) -> bytes:
            return rerank_result(scores, tokens, inp.top_k)

        reply = await self.scoring.score(info, pairs, {}, body, ctx, directives, render)
        return Answer(orjson.loads(reply.body), reply.headers)

    async def _classify(
        self,
        info: ModelInfo,
        inp: ClassificationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Answer:
        """Through ``/v1/classify``'s serving path (exact and semantic caches included)."""
        body = {"model": info.id, "input": inp.text}
        reply = await self.pooling.classify(info, [inp.text], body, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        labels = self.registry.classifier_backend(info).labels
        return Answer(classification_result(reply.body, labels), reply.headers)
