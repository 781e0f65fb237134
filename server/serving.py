"""The serving object behind the OpenAI routes: validate, resolve the model, call the backend.

Routes stay thin: they read the body and hand it here; this module returns a `Reply` that
the route turns into a Litestar response. Answers of vLLM pass through byte for byte.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from backends.protocol import BackendError, RequestContext, UpstreamStream
from backends.registry import ModelInfo, ModelRegistry, Task
from server.errors import ApiError
from server.metrics import GatewayMetrics
from server.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InputError,
    embedding_inputs,
)
from server.sse import SSEReader, error_event

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class Reply:
    """What a route sends back: a complete body or a byte stream."""

    status: int
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
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


class OpenAIServing:
    """Implements /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models."""

    def __init__(self, registry: ModelRegistry, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

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

    async def chat(self, body: dict[str, Any], ctx: RequestContext) -> Reply:
        req = msgspec.convert(body, ChatCompletionRequest)
        info = self.resolve(req.model, "chat")
        return await self._generate(
            "/v1/chat/completions", "chat", info, body, bool(req.stream), ctx
        )

    async def completions(self, body: dict[str, Any], ctx: RequestContext) -> Reply:
        req = msgspec.convert(body, CompletionRequest)
        info = self.resolve(req.model, "chat")
        return await self._generate(
            "/v1/completions", "completions", info, body, bool(req.stream), ctx
        )

    async def _generate(
        self,
        path: str,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        stream: bool,
        ctx: RequestContext,
    ) -> Reply:
        backend = self.registry.generation_backend(info)
        upstream = {**body, "model": backend.served_model}
        started = time.perf_counter()
        try:
            if not stream:
                resp = await backend.post(path, upstream, ctx)
                self.metrics.latency.labels(route, "false").observe(time.perf_counter() - started)
                if resp.status == 200:
                    self._count_usage(info, resp.body)
                return Reply(resp.status, resp.body, media_type=resp.content_type)
            opened = await backend.open_stream(path, upstream, ctx)
        except BackendError as exc:
            self.metrics.backend_errors.labels(backend.name, exc.kind).inc()
            raise
        if opened.status != 200:
            # vLLM rejected the request before streaming (e.g. prompt too long): relay its error.
            return Reply(opened.status, await opened.read_all())
        return Reply(
            200,
            stream=self._relay(opened, route, info, backend.name, started),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def _relay(
        self, upstream: UpstreamStream, route: str, info: ModelInfo, backend: str, started: float
    ) -> AsyncIterator[bytes]:
        """Relay chunks as they arrive; a broken upstream ends the stream with an error event."""
        reader = SSEReader()
        first = True
        try:
            async for chunk in upstream.chunks():
                if first:
                    self.metrics.ttft.labels(route).observe(time.perf_counter() - started)
                    first = False
                reader.feed(chunk)
                yield chunk
        except BackendError as exc:
            self.metrics.backend_errors.labels(backend, exc.kind).inc()
            yield error_event(
                f"The backend failed mid-answer: {exc.message}", code="backend_stream_broken"
            )
            return
        finally:
            await upstream.aclose()
        if not reader.done:
            self.metrics.backend_errors.labels(backend, "broken").inc()
            yield error_event("The backend ended the answer early.", code="backend_stream_broken")
            return
        self.metrics.latency.labels(route, "true").observe(time.perf_counter() - started)
        self.metrics.count_usage(info.id, reader.usage())

    def _count_usage(self, info: ModelInfo, body: bytes) -> None:
        try:
            usage = orjson.loads(body).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return
        self.metrics.count_usage(info.id, usage if isinstance(usage, dict) else None)

    # -- embeddings ---------------------------------------------------------------

    async def embeddings(self, body: dict[str, Any], ctx: RequestContext) -> Reply:
        req = msgspec.convert(body, EmbeddingRequest)
        info = self.resolve(req.model, "embeddings")
        if info.backend_name in self.registry.generation:
            return await self._generate("/v1/embeddings", "embeddings", info, body, False, ctx)
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
        texts = [t if isinstance(t, str) else backend.detokenize(t) for t in items]
        started = time.perf_counter()
        result = await backend.embed(texts)
        self.metrics.latency.labels("embeddings", "false").observe(time.perf_counter() - started)
        vectors = result.vectors
        data: list[dict[str, Any]] = []
        for i in range(len(texts)):
            vec: Any = vectors[i]
            if req.encoding_format == "base64":
                vec = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": vec})
        tokens = sum(result.token_counts)
        self.metrics.count_usage(info.id, {"prompt_tokens": tokens})
        out = {
            "object": "list",
            "data": data,
            "model": info.id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Reply(200, orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY))
