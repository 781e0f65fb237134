"""A streamed answer inspected as it passes: each choice's text is held back a bounded
window, so a value split across chunks is seen whole before any of it leaves; what leaves
is redacted; a block ends the stream (the caller sends the route's error event).

Works on the ``data:`` payloads of chat and completion streams (Workers AI's streams are
translated from them). The window is analysed once it holds twice ``hold_back_chars``; the
older half leaves then, the rest at the choice's ``finish_reason``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from foundation.request import RequestContext
from foundation.sse import DONE
from semcache.guard_rules import GuardRule
from semcache.policy import Policy
from server.guard.detectors import Detectors
from server.guard.inspector import Guard, blocked


class StreamGuard:
    """One streamed answer's inspection (chat or completions payloads)."""

    def __init__(
        self,
        guard: Guard,
        policy: Policy,
        rule: GuardRule,
        detectors: Detectors | None,
        ctx: RequestContext,
    ) -> None:
        self.guard = guard
        self.policy = policy
        self.rule = rule
        self.detectors = detectors
        self.ctx = ctx
        self.window = policy.guard.hold_back_chars
        self._pending: dict[int, str] = {}
        self._released: dict[int, list[str]] = {}
        """The text sent so far, kept only when a guardrail scores the whole answer."""
        self._keep_text = bool(rule.guardrails.model and rule.guardrails.answer)

    def feed(self, item: bytes) -> bytes:
        """The payload to send for ``item``: its text held back or redacted; raises the
        route's 400 (:func:`blocked`) when a value the rule blocks appears."""
        if item == DONE or not item.startswith(b"{"):
            return item
        data = orjson.loads(item)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            return item
        if self.detectors is None:  # a guardrail alone: the text is kept for the end
            for choice in choices:
                if isinstance(choice, dict):
                    piece = _text_of(choice)
                    if piece:
                        self._released.setdefault(choice.get("index", 0), []).append(piece)
            return item
        started = time.perf_counter()
        for choice in choices:
            if isinstance(choice, dict):
                self._choice(choice)
        self.guard.metrics.duration.labels("stream").observe(time.perf_counter() - started)
        return orjson.dumps(data)

    def _choice(self, choice: dict[str, Any]) -> None:
        assert self.detectors is not None
        index = choice.get("index", 0)
        delta = choice.get("delta")
        holder, field = (delta, "content") if isinstance(delta, dict) else (choice, "text")
        piece = holder.get(field)
        finished = choice.get("finish_reason") is not None
        text = self._pending.get(index, "") + (piece if isinstance(piece, str) else "")
        if not finished and len(text) < 2 * self.window:
            self._pending[index] = text
            if isinstance(piece, str):
                holder[field] = ""
            return
        entities = self.rule.answer
        found = self.detectors.find(text, entities)
        stopped = [f.entity for f in found if entities[f.entity] == "block"]
        if stopped:
            self._count(found)
            raise blocked("answer", stopped)
        cut = len(text) if finished else len(text) - self.window
        for f in found:
            if f.start < cut < f.end:
                cut = f.start
        leaving = [f for f in found if f.end <= cut]
        self._count(leaving)
        out = self.detectors.redact(
            text[:cut], [f for f in leaving if entities[f.entity] == "redact"]
        )
        self._pending[index] = text[cut:]
        if out or isinstance(piece, str):
            holder[field] = out
        if self._keep_text:
            self._released.setdefault(index, []).append(out)

    def _count(self, found: list[Any]) -> None:
        for f in found:
            action = self.rule.answer[f.entity]
            self.guard.counted(f.entity, action, "answer", self.ctx)
            self.ctx.usage.inspected = True
            self.ctx.usage.findings.append(f"answer:{f.entity}:{action}")

    async def finish(self) -> None:
        """The answer is whole: the guardrail scores it (a block raises the 400)."""
        if not self._keep_text:
            return
        texts = ["".join(parts) for _, parts in sorted(self._released.items())]
        rule = GuardRule(
            prompt={}, answer={}, guardrails=self.rule.guardrails, version=self.rule.version
        )
        verdict = await self.guard.inspect(self.policy, rule, "answer", texts, self.ctx)
        if verdict.blocked:
            raise blocked("answer", verdict.blocked)


def _text_of(choice: dict[str, Any]) -> str | None:
    delta = choice.get("delta")
    piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return piece if isinstance(piece, str) else None


async def stream_guard(
    guard: Guard, policy: Policy, rule: GuardRule, ctx: RequestContext
) -> StreamGuard | None:
    """The inspection of a streamed answer under ``rule``; ``None`` when none applies."""
    rails = rule.guardrails
    if not rule.answer and not (rails.model and rails.answer):
        return None
    detectors = await guard.detectors(policy.guard) if rule.answer else None
    return StreamGuard(guard, policy, rule, detectors, ctx)
