"""Cross-encoder scores (``/v1/score``, ``/v1/rerank``) cached per (query, document) pair.

A scoring request is a list of pairs. Its exact key (the whole request) is looked up first;
on a miss each pair is looked up under its own key (route ``rerank.pair``: the query, the
document and the parameters that change a score), in the same scope, model revision and
purge epochs as the request. Only the pairs no key holds go to vLLM (one ``/score`` call),
and their scores are stored as pairs: a rerank over a list partly seen before computes only
its new documents, as embeddings are answered item by item. Scores are deterministic, so
they are cached whatever the rule says of sampling.

Content rules (``server/guard``) apply to the texts as prompts (route ``rerank``): each query
and document (and a string parameter, such as an instruction) is inspected before any key
is built; a redacted text is scored, keyed and echoed (``return_documents``) in its redacted
form, and a block refuses the request before the caches and vLLM see it. A score is a number:
no answer rule applies to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import orjson

from backends.interfaces import BackendError
from backends.registry import ModelInfo
from foundation.request import RequestContext
from semcache.entry import CachedAnswer, Usage
from semcache.exact import CacheStatus
from server.errors import ApiError, relayed_error
from server.http.reply import Reply
from server.serving.cache_headers import CacheDirectives, edge_headers, result_headers
from server.serving.core import ServingCore
from server.serving.usage_notes import note_items, note_result

ROUTE: Final = "rerank"
PAIR_ROUTE: Final = "rerank.pair"
PAIR_CONTENT_TYPE: Final = "application/x-semcache-score"
SCORE_PATH: Final = "/score"

Pair = tuple[str, str]
Render = Callable[[list[float], list[int], Sequence[Pair]], bytes]
"""Builds the answer from one score and one token count per pair, in the request's order,
and the pairs as scored (redacted where the content rules say)."""


class Scoring:
    """The scoring core (see the module doc)."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def score(
        self,
        info: ModelInfo,
        pairs: Sequence[Pair],
        params: dict[str, Any],
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None,
        render: Render,
    ) -> Reply:
        """The answer ``render`` builds from the scores of ``pairs``; ``params``: the request's
        fields that change a score (truncation, instruction, activation), sent to vLLM and
        part of each pair's key; ``body``: the request as the client sent it (its own key)."""
        core = self.core
        ctx.usage.model, ctx.usage.route = info.id, ROUTE
        ctx.salt_scope = core.scope(info, ROUTE, ctx)
        started = time.perf_counter()
        pairs, params, body, said, version = await self._inspect(info, pairs, params, body, ctx)
        creq = await core.cache_request(ROUTE, info, body, ctx, directives, version)
        if creq is None or core.cache is None:
            scores, tokens = await self._compute(info, list(pairs), params, ctx)
            return Reply(200, render(scores, tokens, pairs), headers=said)
        cache = core.cache
        outcome: dict[str, int] = {}

        async def fill() -> CachedAnswer:
            keys = [creq.part(PAIR_ROUTE, {"query": q, "document": d, **params}) for q, d in pairs]
            found = await asyncio.gather(*(cache.lookup(k) for k in keys))
            scores: list[float] = [0.0] * len(pairs)
            tokens: list[int] = [0] * len(pairs)
            todo: list[int] = []
            for i, res in enumerate(found):
                entry = res.entry
                if res.status in (CacheStatus.HIT, CacheStatus.STALE) and entry and entry.body:
                    scores[i], tokens[i] = (
                        float(orjson.loads(entry.body)),
                        entry.usage.prompt_tokens,
                    )
                else:
                    todo.append(i)
            if todo:
                got, counts = await self._compute(info, [pairs[i] for i in todo], params, ctx)
                stores = []
                for n, i in enumerate(todo):
                    scores[i], tokens[i] = got[n], counts[n]
                    stores.append(cache.store(keys[i], _pair_answer(info, got[n], counts[n])))
                await asyncio.gather(*stores)
            outcome.update(
                served=len(pairs) - len(todo), saved=sum(tokens) - sum(tokens[i] for i in todo)
            )
            return CachedAnswer.from_json(render(scores, tokens, pairs), model_id=info.id)

        try:
            res = await cache.get_or_fill(creq, fill)
        except BackendError as exc:
            core.metrics.backend_errors.labels(info.backend_name, exc.kind).inc()
            raise
        assert res.entry is not None
        core.answered(ctx, creq, res, info, body)
        note_result(ctx.usage, res)
        served = outcome.get("served", 0)
        if served and not res.from_cache and not res.coalesced:
            note_items(ctx.usage, served, len(pairs), outcome.get("saved", 0), 0)
        core.metrics.latency.labels(ROUTE, "false").observe(time.perf_counter() - started)
        headers = {**result_headers(res, creq), **edge_headers(res, creq), **said}
        if served and not res.from_cache and "status" not in creq.hidden:
            headers["x-semcache-pairs-cached"] = f"{served}/{len(pairs)}"
        return Reply(200, res.entry.body or b"", headers=headers)

    async def _inspect(
        self,
        info: ModelInfo,
        pairs: Sequence[Pair],
        params: dict[str, Any],
        body: dict[str, Any],
        ctx: RequestContext,
    ) -> tuple[Sequence[Pair], dict[str, Any], dict[str, Any], dict[str, str], str]:
        """The pairs, parameters and keyed body as the content rules leave them, the headers
        naming what was found and the rules' version (a block raises the route's 400)."""
        guard = self.core.guard
        if guard is None:
            return pairs, params, body, {}, ""
        texts = list(
            dict.fromkeys([t for pair in pairs for t in pair] + _strings_of(params.values()))
        )
        policy = self.core.policy.current
        checked, said, inspection = await guard.begin(policy, info.id, ROUTE, {"input": texts}, ctx)
        if inspection is None:
            return pairs, params, body, said, ""
        version = inspection.rule.version
        new = dict(zip(texts, checked["input"], strict=True))
        if all(new[t] == t for t in texts):
            return pairs, params, body, said, version
        pairs = [(new[q], new[d]) for q, d in pairs]
        params = {k: new.get(v, v) if isinstance(v, str) else v for k, v in params.items()}
        return pairs, params, _replaced(body, new), said, version

    async def _compute(
        self, info: ModelInfo, pairs: list[Pair], params: dict[str, Any], ctx: RequestContext
    ) -> tuple[list[float], list[int]]:
        """vLLM's scores of ``pairs`` (one ``/score`` call: queries and documents paired
        in order) and each pair's share of the call's prompt tokens."""
        backend = self.core.registry.generation_backend(info)
        self.core.announce(backend.name, ctx)
        self.core.metrics.count_backend_call(backend.name, ROUTE, len(pairs))
        body = {
            **params,
            "model": backend.served_model,
            "queries": [q for q, _ in pairs],
            "documents": [d for _, d in pairs],
        }
        resp = await backend.post(SCORE_PATH, body, ctx)
        if resp.status != 200:
            raise relayed_error(resp.status, resp.body)
        doc = orjson.loads(resp.body)
        rows = sorted(doc.get("data") or [], key=lambda row: row.get("index", 0))
        if len(rows) != len(pairs):
            raise ApiError(502, "The backend scored another number of pairs.", code="backend_error")
        usage = doc.get("usage") or {}
        total = int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)
        self.core.metrics.count_usage(info.id, {"prompt_tokens": total})
        ctx.usage.add(total, 0)
        return [float(row["score"]) for row in rows], apportion(total, pairs)


def apportion(total: int, pairs: Sequence[Pair]) -> list[int]:
    """``total`` tokens split over the pairs in proportion to their text (vLLM counts one
    total per call): what each pair is said to cost when it is served from the cache."""
    sizes = [len(q) + len(d) + 1 for q, d in pairs]
    whole = sum(sizes)
    shares = [total * size // whole for size in sizes]
    if shares:
        shares[-1] += total - sum(shares)
    return shares


def _pair_answer(info: ModelInfo, score: float, tokens: int) -> CachedAnswer:
    return CachedAnswer(
        body=orjson.dumps(score),
        content_type=PAIR_CONTENT_TYPE,
        usage=Usage(prompt_tokens=tokens),
        model_id=info.id,
    )


def _strings_of(values: Iterable[Any]) -> list[str]:
    return [v for v in values if isinstance(v, str)]


def _replaced(value: Any, new: dict[str, str]) -> Any:
    """``value`` (a request body) with every string that is a key of ``new`` replaced: the
    body keyed as the redacted texts, whatever its shape (``queries``, ``text_1``,
    ``documents[].text``, Workers AI's ``contexts[].text``)."""
    if isinstance(value, str):
        return new.get(value, value)
    if isinstance(value, list):
        return [_replaced(v, new) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, new) for k, v in value.items()}
    return value
