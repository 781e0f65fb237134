"""The ``model`` judge: a chat model served by one of the configured backends is asked,
with a short prompt, whether two answers agree.

Its reply must be one word, ``yes`` or ``no`` (anything else, or a backend failure, is no
verdict: nothing is learned). The request asks vLLM's structured outputs for exactly one of
the two words (``structured_outputs.choice``, vLLM 0.32), so even a small model that would
otherwise ramble gives a verdict. It lives in server because it calls a backend; the cache's
other judges (``semcache.semantic.verified.judges``) need none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

from backends.interfaces import BackendError, GenerationBackend, UpstreamRejected
from foundation.request import RequestContext
from semcache.semantic.verified.judges import normalised

log = logging.getLogger(__name__)

JUDGE_SYSTEM = (
    "You check whether two answers to the same question agree: same facts, same "
    "conclusion, wording aside. Reply with one word: yes or no."
)
VERDICTS = ["yes", "no"]
"""The judge's only replies: vLLM decodes nothing else (``structured_outputs.choice``)."""
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
            "structured_outputs": {"choice": VERDICTS},
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
