"""vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``) through the exact cache, for
every surface (the OpenAI-side routes, Anthropic's ``count_tokens``).

Their answers depend only on the model's tokenizer and chat template, so they are always
deterministic: cached per tenant (or as the policy shares the model) under the routes
``tokenize`` and ``detokenize``, keyed by the model's revision and template like any answer.
A tokenization computes nothing with the KV cache: it reaches one answering server of the
model's backend (no prefill hop, no ``cache_salt``) and costs no tokens in the ledger.

Content rules (``server/guard``): a tokenization's ``prompt`` or ``messages`` is a prompt
(route ``tokenize``: Anthropic's ``count_tokens`` too), inspected before the key is built and
vLLM sees it. A detokenization's input is token ids, where no detector finds anything; its
answer is text, so the ``detokenize`` route's answer rules apply to it before the client and
the cache see it.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from backends.interfaces import BackendError
from backends.registry import ModelInfo
from foundation.request import RequestContext
from semcache import replay
from semcache.entry import CachedAnswer
from server.errors import ApiError, relayed_error
from server.guard.inspector import Inspection
from server.http.conditional import NO_STORE
from server.http.reply import Reply
from server.serving.cache_headers import CacheDirectives, edge_headers, result_headers
from server.serving.core import ServingCore
from server.serving.usage_notes import note_result

PATHS: Final = {"tokenize": "/tokenize", "detokenize": "/detokenize"}


CACHE_RESULT_HEADERS = frozenset(("cf-aig-cache-status", "cache-status", "age", "x-semcache-key"))
"""What a caller that reshapes a tokenization answer passes on of its headers."""


def upstream_error(reply: Reply) -> ApiError:
    """A backend's error reply as an ApiError, for a surface to answer in its own format."""
    return relayed_error(reply.status, reply.body)


class Tokenization:
    """Tokenize and detokenize through the cache (see the module doc)."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def run(
        self,
        route: str,
        info: ModelInfo,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
    ) -> Reply:
        """``route`` (``tokenize`` or ``detokenize``) of ``body`` (OpenAI-side, ``model`` as
        the client named it) on ``info``'s backend."""
        core = self.core
        backend = core.registry.generation_backend(info)
        ctx.usage.model, ctx.usage.route = info.id, route
        body, said, inspection = await self._inspect(route, info, body, ctx)
        upstream = {**body, "model": backend.served_model}
        path = PATHS[route]

        async def fill() -> CachedAnswer:
            try:
                resp = await backend.post(path, upstream, ctx)
            except BackendError as exc:
                core.metrics.backend_errors.labels(backend.name, exc.kind).inc()
                raise
            core.metrics.count_backend_call(backend.name, route, 1)
            raw = resp.body
            if resp.status == 200 and inspection is not None:  # a block raises: no entry
                raw, found = await inspection.answer(route, raw, ctx)
                said.update(found)
            return CachedAnswer.from_json(
                raw, model_id=info.id, status=resp.status, content_type=resp.content_type
            )

        version = inspection.rule.version if inspection is not None else ""
        creq = await core.cache_request(route, info, body, ctx, directives, version)
        if creq is None or core.cache is None:
            answer = await fill()
            return Reply(answer.status, answer.body or b"", headers=said)
        res = await core.cache.get_or_fill(creq, fill)
        entry = res.entry
        assert entry is not None
        note_result(ctx.usage, res)
        if entry.status != 200:
            return Reply(entry.status, entry.body or b"", headers={"cache-control": NO_STORE})
        headers = {**result_headers(res, creq), **edge_headers(res, creq), **said}
        return Reply(200, replay.as_json(entry, route), headers=headers)

    async def _inspect(
        self, route: str, info: ModelInfo, body: dict[str, Any], ctx: RequestContext
    ) -> tuple[dict[str, Any], dict[str, str], Inspection | None]:
        """A tokenization's prompt as the content rules leave it (a block raises the
        route's 400); a detokenization's rule, for its answer (see the module doc)."""
        guard = self.core.guard
        if guard is None:
            return body, {}, None
        policy = self.core.policy.current
        if route == "tokenize":
            return await guard.begin(policy, info.id, route, body, ctx)
        rule = guard.rule(policy, info.id, route, ctx)
        return body, {}, (Inspection(guard, policy, rule) if rule.active else None)

    async def count(
        self,
        info: ModelInfo,
        body: dict[str, Any],
        ctx: RequestContext,
        directives: CacheDirectives | None = None,
    ) -> tuple[int, dict[str, str]]:
        """The number of tokens ``/tokenize`` counts for ``body`` (an ApiError otherwise), and
        the cache's headers of that answer (what it was: a hit, a miss; not the edge's, whose
        ETag and location are the tokenization's, not the count's)."""
        reply = await self.run("tokenize", info, body, ctx, directives)
        if reply.status != 200:
            raise upstream_error(reply)
        count = orjson.loads(reply.body).get("count")
        if not isinstance(count, int):
            raise ApiError(502, "The backend's tokenizer gave no count.", code="backend_error")
        said = {k: v for k, v in reply.headers.items() if k.lower() in CACHE_RESULT_HEADERS}
        return count, said
