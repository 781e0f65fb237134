"""``POST /v1/score`` and ``POST /v1/rerank``: validated here, the pairs scored by the core
(``server/serving/scoring.py``: cached pair by pair), the answer in each endpoint's shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import orjson

from foundation.request import RequestContext
from server.errors import ApiError
from server.http.reply import Reply
from server.openai.scoring.protocol import NOT_SENT, Document, RerankRequest, ScoreRequest
from server.serving.cache_headers import CacheDirectives
from server.serving.core import ServingCore
from server.serving.scoring import Pair, Scoring


def _pairs(first: str | list[str], second: str | list[str]) -> list[Pair]:
    """vLLM's pairing: one text against each of the others, or two lists in order."""
    left = [first] if isinstance(first, str) else first
    right = [second] if isinstance(second, str) else second
    if len(left) == 1:
        return [(left[0], text) for text in right]
    if len(left) != len(right):
        raise ApiError(
            400,
            f"{len(left)} queries and {len(right)} documents: give one query, or as many "
            "queries as documents (paired in order).",
            code="invalid_value",
        )
    return list(zip(left, right, strict=True))


def _sides(req: ScoreRequest) -> tuple[str | list[str], str | list[str]]:
    for first, second in (
        (req.queries, req.documents if req.documents is not None else req.items),
        (req.text_1, req.text_2),
        (req.data_1, req.data_2),
    ):
        if first is not None and second is not None:
            return first, second
    raise ApiError(
        400,
        "Give `queries` and `documents` (or `text_1` and `text_2`).",
        param="queries",
        code="missing_required_parameter",
    )


def _usage(tokens: list[int]) -> dict[str, int]:
    total = sum(tokens)
    return {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}


class ScoringServing:
    def __init__(self, core: ServingCore, scoring: Scoring) -> None:
        self.core = core
        self.scoring = scoring

    def _params(self, body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k not in NOT_SENT}

    async def score(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None
    ) -> Reply:
        req = msgspec.convert(body, ScoreRequest)
        info = self.core.resolve(req.model, "rerank", ctx)
        pairs = _pairs(*_sides(req))

        def render(scores: list[float], tokens: list[int], _: Sequence[Pair]) -> bytes:
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            return orjson.dumps(
                {
                    "id": f"score-{uuid.uuid4().hex}",
                    "object": "list",
                    "created": int(time.time()),
                    "model": info.id,
                    "data": data,
                    "usage": _usage(tokens),
                }
            )

        keyed = {**body, "endpoint": "score"}
        return await self.scoring.score(
            info, pairs, self._params(body), keyed, ctx, directives, render
        )

    async def rerank(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None
    ) -> Reply:
        req = msgspec.convert(body, RerankRequest)
        info = self.core.resolve(req.model, "rerank", ctx)
        texts = [d.text if isinstance(d, Document) else d for d in req.documents]
        pairs = [(req.query, text) for text in texts]

        def render(scores: list[float], tokens: list[int], scored: Sequence[Pair]) -> bytes:
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            if req.top_n:
                order = order[: req.top_n]
            results = []
            for i in order:
                result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
                if req.return_documents:
                    result["document"] = {"text": scored[i][1]}  # as scored: redacted
                results.append(result)
            return orjson.dumps(
                {
                    "id": f"rerank-{uuid.uuid4().hex}",
                    "model": info.id,
                    "results": results,
                    "usage": _usage(tokens),
                }
            )

        keyed = {**body, "endpoint": "rerank"}
        return await self.scoring.score(
            info, pairs, self._params(body), keyed, ctx, directives, render
        )
