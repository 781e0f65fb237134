"""The generation path that chat completions and completions (and embeddings served by a
generation backend) share: the semantic and exact caches, then the backend.

Answers of vLLM pass through byte for byte; a stream goes through ``cached_stream`` when the
cache is on and ``stream_relay`` when it is not. A request past the model's context is the
exception: its 400 is raised in the route's own words (``context_limit``), a stream's before
any event.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import orjson

from backends.interfaces import BackendError, KnowsContext
from backends.registry import ModelInfo
from backends.vllm.context_refusal import ContextRefusal, context_refusal
from foundation.request import RequestContext
from foundation.sse import MEDIA_TYPE
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest
from server.errors import ApiError
from server.http.conditional import NO_STORE
from server.http.reply import SSE_HEADERS, Reply
from server.serving.cache_headers import CacheDirectives, edge_headers, result_headers
from server.serving.cached_stream import CachedStreams
from server.serving.call import GenerationCall
from server.serving.context_limit import PROMPT_FIELDS, limit_error
from server.serving.core import ServingCore
from server.serving.output_limit import FIELDS, asked, limit_output, noted_json
from server.serving.prompt_tokens import count_prompt
from server.serving.semantic_chat import Remember, semantic_chat
from server.serving.stream_relay import answer_stream, relay, unsupported_stream
from server.serving.tool_fields import TOOL_ROUTES, without_empty_tools
from server.serving.usage_notes import note_result, prefix_cached_of


class Generation:
    """Sends one generation request through the caches to its backend."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.streams = CachedStreams(core)

    async def generate(
        self,
        path: str,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        stream: bool,
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
        *,
        max_tokens_fallback: int | None = None,
        max_tokens_ceiling: bool = False,
    ) -> Reply:
        """``max_tokens_fallback``: the default ``max_tokens`` when the policy's rule has
        none (a surface's own, as Workers AI's 256); ``max_tokens_ceiling``: the request's
        own ``max_tokens`` is a ceiling the context may lower (Workers AI's), not a demand."""
        core = self.core
        if route in TOOL_ROUTES:  # `tools: []` is no tools, for the backend and the key
            body = without_empty_tools(body)
        backend = core.registry.generation_backend(info)
        ctx.salt_scope = core.scope(info, route, ctx)
        ctx.usage.model, ctx.usage.route = info.id, route
        inspection, guard_headers = None, dict[str, str]()
        if core.guard is not None:  # the prompt as the rules leave it: the key is built on it
            policy = core.policy.current
            body, guard_headers, inspection = await core.guard.begin(
                policy, info.id, route, body, ctx
            )
            if stream and route == "responses" and inspection and inspection.answers:
                raise unsupported_stream()
        rule = core.policy.current.rule(info.id, route)
        context = await backend.max_model_len() if isinstance(backend, KnowsContext) else None
        body, limit = limit_output(
            route,
            body,
            rule.max_tokens,
            max_tokens_fallback,
            context=context,
            ceiling=max_tokens_ceiling,
        )
        call = GenerationCall(
            path=path,
            route=route,
            info=info,
            backend=backend,
            upstream={**body, "model": backend.served_model},
            ctx=ctx,
            started=time.perf_counter(),
            metrics=core.metrics,
            inspection=inspection,
            output_limit=limit,
        )
        bound = asked(route, body)
        if context and bound is not None and bound[1] > context:  # vLLM would refuse it
            raise await _past_context(call, ContextRefusal("output", context, asked=bound[1]))
        version = inspection.rule.version if inspection else ""
        # The note is part of the stored answer, so of its key too.
        keyed = body if limit.note is None else {**body, **limit.note}
        creq = await core.cache_request(route, info, keyed, ctx, directives, version)
        if creq is None:
            reply = await _checked(call, await self._forward(call, stream))
            reply.headers.update(guard_headers)
            return reply
        # the partition is of the body as keyed: an answer noted otherwise is another's
        plan = await semantic_chat(core, call, creq, keyed, stream, directives)
        if plan.hit is not None:
            plan.hit.headers.update(guard_headers)
            return plan.hit
        remember = plan.remember
        if remember is not None:
            # The semantic record written after the store points to this answer: no record
            # may outlive its answer on disk after a crash.
            creq = msgspec.structs.replace(creq, write_through=True)
        if not stream:
            reply = await self._cached_json(call, creq, body, remember)
        else:
            reply = await self.streams.reply(call, creq, body, remember)
        reply = await _checked(call, reply)
        reply.headers.update(plan.headers)
        reply.headers.update(guard_headers)
        return reply

    async def _forward(self, call: GenerationCall, stream: bool) -> Reply:
        """No cache: relay the backend's bytes as they are."""
        self.core.announce(call.backend.name, call.ctx)
        try:
            if not stream:
                resp = await call.backend.post(call.path, call.upstream, call.ctx)
                call.observe_latency(stream=False)
                if resp.status != 200:
                    return Reply(resp.status, resp.body, media_type=resp.content_type)
                call.count_usage(_usage_of(resp.body))
                body = noted_json(resp.body, call.output_limit)
                if call.inspection is None:
                    return Reply(200, body, media_type=resp.content_type)
                body, said = await call.inspection.answer(call.route, body, call.ctx)
                return Reply(200, body, media_type=resp.content_type, headers=said)
            opened = await call.backend.open_stream(call.path, call.upstream, call.ctx)
        except BackendError as exc:
            call.backend_failed(exc.kind)
            raise
        if opened.status != 200:
            # vLLM rejected the request before streaming (e.g. prompt too long): relay its error.
            return Reply(opened.status, await opened.read_all())
        inspected = await answer_stream(call)
        return Reply(
            200, stream=relay(call, opened, inspected), media_type=MEDIA_TYPE, headers=SSE_HEADERS
        )

    async def _cached_json(
        self,
        call: GenerationCall,
        creq: CacheRequest,
        body: dict[str, Any],
        remember: Remember | None = None,
    ) -> Reply:
        assert self.core.cache is not None
        said: dict[str, str] = {}

        async def fill() -> CachedAnswer:
            self.core.announce(call.backend.name, call.ctx)
            try:
                resp = await call.backend.post(call.path, call.upstream, call.ctx)
            except BackendError as exc:
                call.backend_failed(exc.kind)
                raise
            raw = resp.body
            if resp.status == 200 and call.inspection is not None:  # a block raises: no entry
                raw, found = await call.inspection.answer(call.route, raw, call.ctx)
                said.update(found)
            # a non-200 answer is handed to coalesced waiters but never stored
            body = noted_json(raw, call.output_limit) if resp.status == 200 else raw
            answer = CachedAnswer.from_json(
                body, model_id=call.info.id, status=resp.status, content_type=resp.content_type
            )
            if resp.status == 200:  # the body is parsed once, for the answer's usage
                usage = answer.usage
                call.metrics.count_tokens(
                    call.info.id, usage.prompt_tokens, usage.completion_tokens
                )
                call.ctx.usage.add(
                    usage.prompt_tokens, usage.completion_tokens, prefix_cached_of(resp.body)
                )
            return answer

        res = await self.core.cache.get_or_fill(creq, fill)
        entry = res.entry
        assert entry is not None  # fill always answers (or raises)
        if res.stored and remember is not None:
            await remember()
        call.observe_latency(stream=False)
        note_result(call.ctx.usage, res)
        self.core.answered(call.ctx, creq, res, call.info, body)
        if entry.status == 200:
            headers = {**result_headers(res, creq), **edge_headers(res, creq), **said}
        else:
            headers = {"cache-control": NO_STORE}
        return Reply(entry.status, replay.as_json(entry, call.route), headers=headers)


async def _checked(call: GenerationCall, reply: Reply) -> Reply:
    """``reply``, unless it is vLLM's refusal of a request past the context: then that
    refusal in the route's words is raised."""
    if reply.status == 400 and reply.stream is None and call.route in PROMPT_FIELDS:
        refusal = context_refusal(reply.status, reply.body)
        if refusal is not None:
            raise await _past_context(call, refusal)
    return reply


async def _past_context(call: GenerationCall, refusal: ContextRefusal) -> ApiError:
    """The error for ``refusal``, with the prompt counted where it was not (all of it)."""
    if refusal.prompt is None or not refusal.exact:
        counted = await count_prompt(call)
        if counted is not None:
            kind = "prompt" if counted > refusal.context else refusal.kind
            refusal = refusal._replace(kind=kind, prompt=counted, exact=True)
    bound = asked(call.route, call.upstream)
    field = bound[0] if bound is not None else FIELDS[call.route][-1]
    return limit_error(call.route, field, call.info.id, refusal)


def _usage_of(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON answer, if it has one."""
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None
