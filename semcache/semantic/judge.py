"""Judges of an explored request: was the cached answer right, given the fresh one?

A verified partition (``semcache.semantic.verified``) learns from these verdicts. The judge
compares the answer of the entry that would have been served with the backend's answer to
the request itself:

- ``exact``: the two answers are equal once case and spacing are normalised (temperature-0
  answers of a deterministic model say the same thing the same way);
- ``embedding``: the cosine of the two answers' vectors, by the cache's own encoder, reaches
  a bound (answers worded differently but meaning the same);
- ``model``: a chat model served by one of the configured backends is asked, with a short
  prompt, whether the two answers agree; its reply must be one word, ``yes`` or ``no``
  (anything else, or a backend failure, is no verdict: nothing is learned).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import orjson

from backends.protocol import BackendError, GenerationBackend, RequestContext, UpstreamRejected
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.semantic.encoder import Encoder
from semcache.semantic.settings import SemanticRule

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


JUDGE_SYSTEM = (
    "You check whether two answers to the same question agree: same facts, same "
    "conclusion, wording aside. Reply with one word: yes or no."
)
MAX_ANSWER_CHARS = 4000
"""Each text is cut to this length in the judge's prompt (keeps its calls short)."""


def judge_messages(cached: str, fresh: str, question: str) -> list[dict[str, str]]:
    def cut(text: str) -> str:
        return text[:MAX_ANSWER_CHARS]

    user = (
        f"Question:\n{cut(question)}\n\nFirst answer:\n{cut(cached)}\n\n"
        f"Second answer:\n{cut(fresh)}\n\nDo the two answers agree? Reply yes or no."
    )
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def parse_verdict(body: bytes) -> bool | None:
    """The judge's reply as a verdict: exactly ``yes`` or ``no`` (case, spacing and one
    final full stop aside); None for anything else."""
    try:
        content: Any = orjson.loads(body)["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(content, str):
        return None
    word = content.strip().casefold()
    word = word[:-1].rstrip() if word.endswith(".") else word
    return {"yes": True, "no": False}.get(word)


class ModelJudge:
    """Asks a chat model, through its backend, whether the two answers agree."""

    def __init__(
        self,
        backend: GenerationBackend,
        ctx: RequestContext,
        *,
        max_tokens: int = 4,
        on_usage: Callable[[dict[str, Any] | None], None] | None = None,
    ) -> None:
        self.backend = backend
        self.ctx = ctx
        """The explored request's routing facts (tenant, prefix-cache scope)."""
        self.max_tokens = max_tokens
        self.on_usage = on_usage
        """Told the judge call's ``usage`` (it is real backend traffic)."""

    async def same(self, cached: str, fresh: str, question: str = "") -> bool | None:
        if normalised(cached) == normalised(fresh):
            return True
        body = {
            "model": self.backend.served_model,
            "messages": judge_messages(cached, fresh, question),
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        try:
            reply = await self.backend.post("/v1/chat/completions", body, self.ctx)
        except (BackendError, UpstreamRejected) as exc:
            log.warning("the judge model %s failed: %s", self.backend.served_model, exc)
            return None
        if reply.status != 200:
            return None
        if self.on_usage is not None:
            try:
                self.on_usage(orjson.loads(reply.body).get("usage"))
            except (orjson.JSONDecodeError, AttributeError):
                pass
        verdict = parse_verdict(reply.body)
        if verdict is None:
            log.warning("the judge model %s did not answer yes or no", self.backend.served_model)
        return verdict


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
