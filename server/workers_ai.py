"""Cloudflare Workers AI's REST surface (``/client/v4/accounts/{id}/ai/run/{model}``).

Maps Workers-AI inputs onto the OpenAI serving object (so the same caches and backends
answer both APIs) and its answers back into Cloudflare's shapes:

- text generation: ``prompt`` or ``messages`` → ``{"response", "usage"}``; with
  ``stream: true`` the events ``data: {"response": "<piece>"}`` and a final ``data: [DONE]``;
- text embeddings: ``text`` (a string or a list) → ``{"shape": [n, dim], "data", "pooling"}``;
- text classification: ``text`` → ``[{"label", "score"}, ...]`` (best first);
- asynchronous batches: ``{"requests": [...]}`` with ``queueRequest`` → ``{"status":
  "queued", "request_id", "model"}``; ``{"request_id"}`` polls (see ``server.batch``).

Every JSON answer is wrapped in the envelope ``{"result", "success", "errors", "messages"}``;
errors are raised as ``ApiError`` and wrapped by ``server.errors`` for ``/client/v4`` paths.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Mapping
from typing import Annotated, Any, Literal

import msgspec
import orjson
from prometheus_client import CollectorRegistry

from backends.classifier import label_names
from backends.protocol import BackendError, RequestContext
from backends.registry import ModelInfo, ModelRegistry
from server.auth import TokenAuth
from server.batch.gates import CapacityGates
from server.batch.metrics import BatchMetrics
from server.batch.queue import open_queue
from server.batch.results import USAGE_KEYS, ItemOutcome
from server.batch.service import BatchService
from server.batch.settings import BatchSettings
from server.batch.workers import BatchWorkers
from server.caching import CacheDirectives
from server.config import GatewayConfig
from server.errors import ApiError, from_backend, from_validation
from server.serving import SSE_HEADERS, ClosingStream, OpenAIServing, Reply, aclose_stream
from server.sse import DONE, SSEReader, event

log = logging.getLogger("semcache.workers_ai")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.6
"""Workers AI's defaults for text generation (they differ from OpenAI's)."""

_OPENAI_SAMPLING = (
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "stop",
)


class TextGenerationInput(msgspec.Struct, kw_only=True):
    """Workers AI text-generation input (``prompt`` or ``messages``)."""

    prompt: NonEmptyStr | None = None
    messages: list[dict[str, Any]] | None = None
    raw: bool = False
    stream: bool = False
    max_tokens: PositiveInt = DEFAULT_MAX_TOKENS
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=5.0)] = DEFAULT_TEMPERATURE
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=1, le=50)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=1, le=9_999_999_999)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    response_format: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    lora: str | None = None


class EmbeddingInput(msgspec.Struct, kw_only=True):
    text: NonEmptyStr | Annotated[list[NonEmptyStr], msgspec.Meta(min_length=1)]
    pooling: Literal["mean", "cls"] = "mean"


class ClassificationInput(msgspec.Struct, kw_only=True):
    text: NonEmptyStr


# -- shapes ----------------------------------------------------------------------------


def envelope(result: Any) -> bytes:
    """Cloudflare's success envelope."""
    return orjson.dumps({"result": result, "success": True, "errors": [], "messages": []})


def error_object(err: ApiError) -> dict[str, Any]:
    """An entry of the envelope's ``errors`` (the codes ``server.errors`` uses)."""
    return {"code": err.status * 10, "message": err.message}


def truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return value is True


def workers_usage(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    out = {k: int(usage.get(k) or 0) for k in USAGE_KEYS}
    if not out["total_tokens"]:
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def upstream_error(reply: Reply) -> ApiError:
    """An OpenAI/vLLM error answer as an ApiError with the same status and message."""
    message = f"The model failed with status {reply.status}."
    code: str | None = None
    try:
        body = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        inner = body.get("error")
        err: dict[str, Any] = inner if isinstance(inner, dict) else body
        if isinstance(err.get("message"), str):
            message = err["message"]
        if isinstance(err.get("code"), str):
            code = err["code"]
    return ApiError(reply.status, message, code=code)


def context_overflow(reply: Reply) -> bool:
    """vLLM refused ``max_tokens`` because it goes past the model's context."""
    err = upstream_error(reply)
    text = err.message.lower()
    return "max_tokens" in text and ("max_model_len" in text or "context length" in text)


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers AI accepts ``{name, description, parameters}`` as well as OpenAI's form."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if "function" in tool:
            out.append(tool)
        else:
            out.append({"type": "function", "function": tool})
    return out


def workers_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for call in calls:
        fn = call.get("function") or {}
        args: Any = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                pass
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def text_result(route: str, body: bytes) -> dict[str, Any]:
    """An OpenAI completion (chat or text) as a Workers-AI text-generation result."""
    answer = orjson.loads(body)
    choices = answer.get("choices") or [{}]
    first = choices[0]
    if route == "chat":
        message = first.get("message") or {}
        result: dict[str, Any] = {"response": message.get("content") or ""}
        if message.get("tool_calls"):
            result["tool_calls"] = workers_tool_calls(message["tool_calls"])
    else:
        result = {"response": first.get("text") or ""}
    result["usage"] = workers_usage(answer.get("usage"))
    return result


async def workers_stream(source: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """OpenAI SSE chunks → Workers-AI events: ``{"response": piece}``…, usage, ``[DONE]``.

    An error event of the source ends the stream with ``{"errors": [...]}`` and no
    ``[DONE]``, so a client can tell a cut answer from a complete one.
    """
    reader = SSEReader()
    usage: dict[str, int] | None = None
    async for chunk in source:
        for payload in reader.feed(chunk):
            if payload == DONE:
                yield event(orjson.dumps({"response": "", "usage": usage or workers_usage(None)}))
                yield event(DONE)
                return
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(data, dict):
                continue
            if isinstance(data.get("error"), dict):
                err = data["error"]
                message = err.get("message") or "The model failed mid-answer."
                yield event(orjson.dumps({"errors": [{"code": 5020, "message": message}]}))
                return
            if data.get("usage"):
                usage = workers_usage(data["usage"])
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") if "delta" in choice else choice.get("text")
                if piece:
                    yield event(orjson.dumps({"response": piece}))
    message = "The model ended the answer early."
    yield event(orjson.dumps({"errors": [{"code": 5020, "message": message}]}))


# -- the serving object ---------------------------------------------------------------


class WorkersAIServing:
    """Implements ``POST /client/v4/accounts/{account_id}/ai/run/{model}``."""

    def __init__(
        self,
        openai: OpenAIServing,
        registry: ModelRegistry,
        auth: TokenAuth,
        *,
        batch: BatchService | None = None,
    ) -> None:
        self.openai = openai
        self.registry = registry
        self.auth = auth
        self.batch = batch
        self.workers: BatchWorkers | None = None
        """This gateway's batch workers; live requests are announced to their gates."""

    async def aclose(self) -> None:
        if self.workers is not None:
            await self.workers.aclose()
            self.workers = None
        if self.batch is not None:
            await self.batch.queue.aclose()
            self.batch = None

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
        directives = directives or CacheDirectives()
        given = body.get("options")
        options: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        queued = (
            queue_request or truthy(body.get("queueRequest")) or truthy(options.get("queueRequest"))
        )
        tenant = ctx.tenant or "anonymous"
        if "request_id" in body and "requests" not in body:
            return Reply(200, envelope(await self._batches().poll(tenant, body["request_id"])))
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
            queued_result = await self._batches().submit(tenant, model, requests)
            return Reply(200, envelope(queued_result))
        inputs = {k: v for k, v in body.items() if k not in ("options", "queueRequest")}
        self.live_request(info)
        result: Any
        headers: dict[str, str]
        if info.task == "chat":
            inp = msgspec.convert(inputs, TextGenerationInput)
            if inp.stream:
                return await self._stream_text(info, inp, ctx, directives)
            result, headers = await self._text(info, inp, ctx, directives)
        elif info.task == "embeddings":
            result, headers = await self._embed(
                info, msgspec.convert(inputs, EmbeddingInput), ctx, directives
            )
        else:
            result, headers = await self._classify(
                info, msgspec.convert(inputs, ClassificationInput), ctx, directives
            )
        return Reply(200, envelope(result), headers=headers)

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        """One item of a batch, through the same path (and caches) as a live request."""
        result: Any
        try:
            info = self.resolve(model)
            directives = CacheDirectives()
            if info.task == "chat":
                inp = msgspec.convert({**body, "stream": False}, TextGenerationInput)
                result, _ = await self._text(info, inp, ctx, directives)
            elif info.task == "embeddings":
                result, _ = await self._embed(
                    info, msgspec.convert(body, EmbeddingInput), ctx, directives
                )
            else:
                result, _ = await self._classify(
                    info, msgspec.convert(body, ClassificationInput), ctx, directives
                )
        except msgspec.ValidationError as exc:
            return ItemOutcome(success=False, errors=[error_object(from_validation(exc))])
        except BackendError as exc:
            err = from_backend(exc)
            return ItemOutcome(success=False, errors=[error_object(err)], retryable=True)
        except ApiError as exc:
            retryable = exc.status in (408, 429, 502, 503, 504)
            return ItemOutcome(success=False, errors=[error_object(exc)], retryable=retryable)
        usage = result.get("usage") if isinstance(result, dict) else None
        return ItemOutcome(success=True, result=result, usage=usage)

    # -- helpers -----------------------------------------------------------------------------

    def live_request(self, info: ModelInfo) -> None:
        """Sync first: batch items running on the model's backend stop before this request
        is sent (they go back to the queue). The OpenAI routes may call it too."""
        if self.workers is not None:
            self.workers.gates.live_request(info.backend_name)

    def resolve(self, model: str) -> ModelInfo:
        info = self.registry.resolve(model)
        if info is None:
            raise ApiError(400, f"No such model {model} or task", code="model_not_found")
        return info

    def _batches(self) -> BatchService:
        if self.batch is None:
            raise ApiError(
                400, "Queued requests are disabled on this gateway.", code="batch_disabled"
            )
        return self.batch

    def _validate_item(self, info: ModelInfo, item: dict[str, Any], index: int) -> None:
        fields = {k: v for k, v in item.items() if k != "external_reference"}
        schema: type[Any] = {
            "chat": TextGenerationInput,
            "embeddings": EmbeddingInput,
        }.get(info.task, ClassificationInput)
        try:
            msgspec.convert(fields, schema)
        except msgspec.ValidationError as exc:
            err = from_validation(exc)
            where = f"requests[{index}]" + (f".{err.param}" if err.param else "")
            raise ApiError(
                400,
                err.message.replace(f"'{err.param}'", f"'{where}'"),
                param=where,
                code="invalid_value",
            ) from None

    async def _openai_text_body(
        self, info: ModelInfo, inp: TextGenerationInput
    ) -> tuple[str, dict[str, Any]]:
        if inp.lora is not None:
            raise ApiError(405, f"The model {info.id} does not support LoRa inference", code="lora")
        if (inp.prompt is None) == (inp.messages is None):
            raise ApiError(
                400, "Send exactly one of `prompt` and `messages`.", code="invalid_value"
            )
        body: dict[str, Any] = {
            "model": info.id,
            "max_tokens": inp.max_tokens,
            "temperature": inp.temperature,
        }
        for name in _OPENAI_SAMPLING:
            value = getattr(inp, name)
            if value is not None:
                body[name] = value
        if inp.messages is not None:
            body["messages"] = inp.messages
            if inp.tools:
                body["tools"] = openai_tools(inp.tools)
            return "chat", body
        if inp.raw:
            body["prompt"] = inp.prompt
            return "completions", body
        body["messages"] = [{"role": "user", "content": inp.prompt}]
        return "chat", body

    async def _call_text(
        self,
        route: str,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Reply:
        call = self.openai.chat if route == "chat" else self.openai.completions
        reply = await call(body, ctx, directives)
        if reply.status == 400 and context_overflow(reply):
            # Workers AI's `max_tokens` is a ceiling, vLLM's a demand it refuses past the
            # context left; without one, vLLM generates up to what is left, the same ceiling.
            body = {k: v for k, v in body.items() if k != "max_tokens"}
            reply = await call(body, ctx, directives)
        return reply

    async def _text(
        self,
        info: ModelInfo,
        inp: TextGenerationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        route, body = await self._openai_text_body(info, inp)
        reply = await self._call_text(route, body, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        return text_result(route, reply.body), reply.headers

    async def _stream_text(
        self,
        info: ModelInfo,
        inp: TextGenerationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> Reply:
        route, body = await self._openai_text_body(info, inp)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        reply = await self._call_text(route, body, ctx, directives)
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
            media_type="text/event-stream",
            headers=headers,
        )

    async def _embed(
        self,
        info: ModelInfo,
        inp: EmbeddingInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        if inp.pooling != "mean":
            raise ApiError(
                400,
                f"The model {info.id} only supports mean pooling.",
                param="pooling",
                code="invalid_value",
            )
        texts = [inp.text] if isinstance(inp.text, str) else list(inp.text)
        reply = await self.openai.embeddings({"model": info.id, "input": texts}, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        answer = orjson.loads(reply.body)
        rows = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
        data = [row["embedding"] for row in rows]
        usage = workers_usage(answer.get("usage"))
        result = {
            "shape": [len(data), len(data[0]) if data else 0],
            "data": data,
            "pooling": "mean",
            "usage": usage,
        }
        return result, reply.headers

    async def _classify(
        self,
        info: ModelInfo,
        inp: ClassificationInput,
        ctx: RequestContext,
        directives: CacheDirectives,
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Through ``/v1/classify``'s serving path (exact and semantic caches included)."""
        reply = await self.openai.classify({"model": info.id, "input": inp.text}, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        (row,) = orjson.loads(reply.body)["data"]
        labels = label_names(self.registry.classifier_backend(info).labels, len(row["probs"]))
        scored = sorted(zip(labels, row["probs"], strict=True), key=lambda p: -p[1])
        return [{"label": label, "score": score} for label, score in scored], reply.headers


# -- assembly -------------------------------------------------------------------------


async def open_workers_ai(
    config: GatewayConfig,
    openai: OpenAIServing,
    registry: ModelRegistry,
    metrics_registry: CollectorRegistry,
    *,
    settings: BatchSettings | None = None,
) -> WorkersAIServing:
    """Build the Workers-AI surface for ``config`` and start this gateway's batch workers."""
    auth = TokenAuth(config.auth)
    settings = settings or config.batch
    wai = WorkersAIServing(openai, registry, auth)
    if settings.enabled:
        queue = await open_queue(settings.queue, config.data_path())
        wai.batch = BatchService(queue, settings)
        wai.workers = BatchWorkers(
            queue, wai, CapacityGates(registry, settings), settings, BatchMetrics(metrics_registry)
        )
        wai.workers.start()
    return wai
