"""The semantic cache in front of chat: a hit for a near-identical question, or how to index
the answer once the exact cache has stored it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from semcache import replay
from semcache.exact import CacheRequest
from semcache.semantic.chat import chat_partition, chat_query, with_query
from semcache.sse import MEDIA_TYPE
from server.caching import CacheDirectives, semantic_headers
from server.openai.call import GenerationCall
from server.openai.reply import SSE_HEADERS, Reply
from server.openai.state import ServingState
from server.openai.stream_format import DataChunks
from server.openai.stream_relay import replayed
from server.openai.usage import note_semantic

Remember = Callable[[], Awaitable[None]]
"""Adds a stored chat answer to the semantic index."""


async def semantic_chat(
    state: ServingState,
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
        or state.semantic is None
        or state.cache is None
        or not creq.cacheable
        or (directives is not None and directives.custom_key is not None)
    ):
        return None, None
    query = chat_query(body)
    if query is None:
        return None, None
    index, text = query
    semantic = await state.semantic.get()
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
    other = await state.cache_request(
        call.route, call.info, with_query(body, index, match.text), call.ctx, directives
    )
    assert other is not None
    res = await state.cache.lookup(other)
    entry = res.entry
    if not res.from_cache or entry is None or entry.status != 200:
        await semantic.remove(partition, [match.payload_ref])
        return None, remember
    # also counted as an exact hit: the matched answer is read through the exact cache
    call.metrics.semantic_hits.labels(call.info.id, call.route).inc()
    headers = semantic_headers(1, 1, match.similarity, creq.key.short_id, stored=False)
    note_semantic(call.ctx.usage, 1, 1, entry.usage.prompt_tokens, entry.usage.completion_tokens)
    if match.verifier_prob is not None:
        headers["x-semcache-verifier-prob"] = f"{match.verifier_prob:.4f}"
    call.observe_latency(stream=stream)
    if not stream:
        return Reply(200, replay.as_json(entry, call.route), headers=headers), None
    include_usage = replay.wants_usage(call.upstream)
    payloads = replay.as_stream(entry, call.route, include_usage=include_usage)
    return (
        Reply(
            200,
            stream=replayed(payloads, DataChunks()),
            media_type=MEDIA_TYPE,
            headers={**SSE_HEADERS, **headers},
        ),
        None,
    )
