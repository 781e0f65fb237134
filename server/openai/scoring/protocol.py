"""``/v1/score`` and ``/v1/rerank`` (vLLM's scoring API, Jina's and Cohere's rerank shape):
the fields the gateway reads. Texts only: a pair of text is what a cross-encoder scores."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from foundation.config_types import NonEmptyStr

Texts = str | Annotated[list[str], msgspec.Meta(min_length=1)]

PAIR_FIELDS: Final = frozenset(
    {"text_1", "text_2", "queries", "documents", "items", "data_1", "data_2", "query"}
)
NOT_SENT: Final = frozenset(
    {"model", "top_n", "return_documents", "user", "request_id", "priority", *PAIR_FIELDS}
)
"""Fields that are not scoring parameters (every other field reaches vLLM and is part of
each pair's cache key: truncation, ``instruction``, ``use_activation``, …)."""


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's forms: ``queries`` and ``documents`` (or ``items``), ``text_1`` and ``text_2``,
    ``data_1`` and ``data_2``; one text against several, or lists paired in order."""

    model: NonEmptyStr
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None


class Document(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    model: NonEmptyStr
    query: str
    documents: Annotated[list[str | Document], msgspec.Meta(min_length=1)]
    top_n: Annotated[int, msgspec.Meta(ge=0)] = 0
    """0: every document."""
    return_documents: bool = True


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: dict[str, Any]


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankList(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, Any]
