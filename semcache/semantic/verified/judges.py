"""Judges of an explored request: was the cached answer right, given the fresh one?

A verified partition (``semcache.semantic.verified.decisions``) learns from these verdicts.
The judge compares the answer of the entry that would have been served with the backend's answer to
the request itself:

- ``exact``: the two answers are equal once case and spacing are normalised (temperature-0
  answers of a deterministic model say the same thing the same way);
- ``embedding``: the cosine of the two answers' vectors, by the cache's own encoder, reaches
  a bound (answers worded differently but meaning the same);
- ``model``: a chat model served by one of the configured backends is asked whether the
  two answers agree. It knows backends, so the server builds it
  (``server.serving.model_judge``) and hands it to :func:`judge_for`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

import numpy as np
import orjson

from semcache import replay
from semcache.entry import CachedAnswer
from semcache.semantic.encoder import Encoder
from semcache.semantic_settings import SemanticRule

log = logging.getLogger(__name__)

_SPACE = re.compile(r"\s+")


class Judge(Protocol):
    async def same(self, cached: str, fresh: str, question: str = "") -> bool | None:
        """Whether ``cached`` answers ``question`` as well as ``fresh`` does (None: no
        verdict)."""
        ...


def normalised(text: str) -> str:
    return _SPACE.sub(" ", text).strip().casefold()


class ExactJudge:
    async def same(self, cached: str, fresh: str, question: str = "") -> bool | None:
        return normalised(cached) == normalised(fresh)


class EmbeddingJudge:
    def __init__(self, encoder: Encoder, min_similarity: float) -> None:
        self.encoder = encoder
        self.min_similarity = min_similarity

    async def same(self, cached: str, fresh: str, question: str = "") -> bool | None:
        if normalised(cached) == normalised(fresh):
            return True
        vectors = await self.encoder.encode([cached, fresh])
        return float(np.dot(vectors[0], vectors[1])) >= self.min_similarity


class NoVerdict:
    """A judge that cannot judge (its model is not in the config): nothing is learned."""

    async def same(self, cached: str, fresh: str, question: str = "") -> bool | None:
        return None


def judge_for(rule: SemanticRule, encoder: Encoder, model: Judge | None = None) -> Judge:
    """The rule's judge; ``model`` is the ``model`` judge, built by the caller (it knows the
    backends)."""
    if rule.judge == "embedding":
        return EmbeddingJudge(encoder, rule.judge_min_similarity)
    if rule.judge == "model":
        return model if model is not None else NoVerdict()
    return ExactJudge()


def chat_text(answer: CachedAnswer) -> str | None:
    """The assistant's text of a stored chat answer (stream or JSON), if it has one."""
    try:
        doc: Any = orjson.loads(replay.as_json(answer, "chat"))
        content = doc["choices"][0]["message"].get("content")
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return content if isinstance(content, str) else None
