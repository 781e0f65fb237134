"""The semantic cache in front of chat: a hit for a near-identical question, or how to index
the answer once the exact cache has stored it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from foundation import tracing as spans
from foundation.request import RequestContext
from foundation.sse import MEDIA_TYPE
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest
from semcache.semantic.cache import SemanticCache
from semcache.semantic.chat import chat_partition, chat_query
from semcache.semantic.match import Match
from semcache.semantic.records import PartitionKey
from semcache.semantic.verified.decisions import Action, Observation
from semcache.semantic.verified.judges import Judge, chat_text, judge_for
from semcache.semantic_settings import SemanticRule
from server.http.reply import SSE_HEADERS, Reply
from server.serving.cache_headers import CacheDirectives, miss_headers, semantic_headers
from server.serving.call import GenerationCall
from server.serving.core import ServingCore
from server.serving.model_judge import ModelJudge
from server.serving.stream_format import DataChunks
from server.serving.stream_relay import replayed
from server.serving.usage_notes import note_semantic

log = logging.getLogger(__name__)

Remember = Callable[[], Awaitable[None]]
"""Adds a stored chat answer to the semantic index (and judges an explored request)."""


@dataclass
class SemanticPlan:
    """What the semantic cache made of a chat request."""

    hit: Reply | None = None
    remember: Remember | None = None
    """Run once the backend's answer is stored (None: nothing to do)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Headers for the backend's answer (an explored request says so)."""


async def semantic_chat(
    state: ServingCore,
    call: GenerationCall,
    creq: CacheRequest,
    body: dict[str, Any],
    stream: bool,
    directives: CacheDirectives | None,
) -> SemanticPlan:
    """A semantic hit for a qualifying chat request, or how to index its answer later.

    Opt-in per model in the policy; temperature 0, single-turn requests only (see
    ``semcache.semantic.chat``). The matched request's answer is read by the digest its
    record holds (the exact entry stored beside it), so purges and expiry apply. A
    verified rule (``mode = "verified"``) serves the nearest entry or explores: the request
    goes to the backend, and its answer, judged against the entry's, adds an observation to
    the entry.
    """
    rule = creq.rule.semantic
    if (
        call.route != "chat"
        or not rule.enabled
        or state.semantic is None
        or state.cache is None
        or not creq.cacheable
        or (directives is not None and directives.custom_key is not None)
    ):
        return SemanticPlan()
    query = chat_query(body)
    if query is None:
        return SemanticPlan()
    index, text = query
    semantic = await state.semantic.get()
    partition = chat_partition(semantic, creq.key, body, index)
    with spans.span("semantic.encode"):
        vectors = await semantic.encode([text])
    control = creq.control
    ttl = control.ttl_s if control.ttl_s is not None else creq.rule.ttl_s
    ttl = max(0, min(ttl, creq.rule.max_ttl_s))

    async def remember() -> None:
        await semantic.insert(
            partition, [text], [creq.key.digest], float(ttl), rule=rule, vectors=vectors
        )

    if control.bypass_read:
        return SemanticPlan(remember=remember)
    tighten = directives.semantic_threshold if directives is not None else None
    with spans.span("cache.semantic", {"semcache.verified": rule.verified}) as span:
        if rule.verified:
            verdict = await semantic.verified_lookup(
                partition, text, rule, tighten, vectors=vectors
            )
            match = verdict[0] if verdict is not None else None
        else:
            verdict = None
            (match,) = await semantic.lookup(partition, [text], rule, tighten, vectors=vectors)
        if span is not None:
            span.set_attribute("semcache.hit", match is not None)
            if match is not None:
                span.set_attribute("semcache.similarity", float(match.similarity))
    if match is None or match.text == text:
        return SemanticPlan(remember=remember)  # an identical text is the exact cache's job
    # The record holds the digest of the entry stored beside it: read that, never a key
    # rebuilt from the matched text (it would miss whatever else went into the key).
    res = await state.cache.lookup_ref(creq, match.payload_ref)
    entry = res.entry
    if not res.from_cache or entry is None or entry.status != 200:
        await semantic.remove(partition, [match.payload_ref])
        return SemanticPlan(remember=remember)
    if verdict is not None and verdict[1].action is Action.EXPLORE:
        events = call.metrics.semantic_verified
        if not semantic.take_explore(partition, rule.explores_per_minute):
            events.labels(call.info.id, "capped").inc()
            return SemanticPlan(remember=remember)
        events.labels(call.info.id, "explore").inc()
        judged = _judged(state, call, creq, semantic, partition, match, entry, text, remember)
        said = {} if "semantic" in creq.hidden else {"x-semcache-semantic": "explore"}
        return SemanticPlan(remember=judged, headers=said)
    if verdict is not None:
        call.metrics.semantic_verified.labels(call.info.id, "exploit").inc()
    # also counted as an exact hit: the matched answer is read through the exact cache
    call.metrics.semantic_hits.labels(call.info.id, call.route).inc()
    note_semantic(call.ctx.usage, 1, 1, entry.usage.prompt_tokens, entry.usage.completion_tokens)
    if "semantic" in creq.hidden:  # another request's answer, said to be a miss
        headers = miss_headers(creq, stream=stream)
    else:
        spared = (entry.usage.prompt_tokens, entry.usage.completion_tokens)
        headers = semantic_headers(
            1,
            1,
            match.similarity,
            creq.key.short_id,
            stored=False,
            saved=None if "saved" in creq.hidden else spared,
            prices=creq.rule.prices,
        )
        if match.verifier_prob is not None:
            headers["x-semcache-verifier-prob"] = f"{match.verifier_prob:.4f}"
    call.observe_latency(stream=stream)
    if not stream:
        return SemanticPlan(hit=Reply(200, replay.as_json(entry, call.route), headers=headers))
    include_usage = replay.wants_usage(call.upstream)
    payloads = replay.as_stream(entry, call.route, include_usage=include_usage)
    return SemanticPlan(
        hit=Reply(
            200,
            stream=replayed(payloads, DataChunks()),
            media_type=MEDIA_TYPE,
            headers={**SSE_HEADERS, **headers},
        )
    )


def _judged(
    state: ServingCore,
    call: GenerationCall,
    creq: CacheRequest,
    semantic: SemanticCache,
    partition: PartitionKey,
    match: Match,
    cached: CachedAnswer,
    question: str,
    remember: Remember,
) -> Remember:
    """Once the explored request's answer is stored: judge the cached answer against it,
    add the observation to the entry, and index the request as an entry of its own when
    the cached answer was wrong for it (a right one already answers its neighbours)."""
    score = match.verifier_prob if match.verifier_prob is not None else match.similarity
    rule = creq.rule.semantic

    async def judged() -> None:
        assert state.cache is not None
        res = await state.cache.lookup(creq)
        fresh = chat_text(res.entry) if res.entry is not None else None
        old = chat_text(cached)
        if fresh is None or old is None:
            await remember()
            return
        judge = judge_for(rule, semantic.encoder, _model_judge(state, call, rule))
        right = await judge.same(old, fresh, question)
        if right is None:
            call.metrics.semantic_verified.labels(call.info.id, "unjudged").inc()
            await remember()
            return
        observation = Observation(similarity=score, correct=right, at=semantic.clock())
        await semantic.observe(partition, match.payload_ref, observation)
        verdict = "judged_right" if right else "judged_wrong"
        call.metrics.semantic_verified.labels(call.info.id, verdict).inc()
        if not right:
            await remember()

    return judged


def _model_judge(state: ServingCore, call: GenerationCall, rule: SemanticRule) -> Judge | None:
    """The ``model`` judge of the rule: its chat model's backend, asked with the explored
    request's routing facts (None: not a model judge, or no such chat model)."""
    if rule.judge != "model" or rule.judge_model is None:
        return None
    info = state.registry.resolve(rule.judge_model)
    if info is None or info.task != "chat":
        log.warning("judge_model %r is not a chat model of the config", rule.judge_model)
        return None
    ctx = RequestContext(
        request_id=f"{call.ctx.request_id}-judge",
        tenant=call.ctx.tenant,
        salt_scope=call.ctx.salt_scope,
    )
    return ModelJudge(
        state.registry.generation_backend(info),
        ctx,
        max_tokens=rule.judge_max_tokens,
        on_usage=lambda usage: call.metrics.count_usage(info.id, usage),
    )
