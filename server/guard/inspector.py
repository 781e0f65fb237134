"""The inspection steps the serving core calls: a prompt before the caches and the backend
see it, a whole answer before the client and the cache do, and a streamed answer chunk by
chunk (``server.guard.stream``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from foundation import tracing as spans
from foundation.request import RequestContext
from semcache.guard_rules import ACTION_RANK, NO_GUARD, GuardRule, GuardSettings
from semcache.policy import Policy
from server.errors import ApiError
from server.guard.detectors import Detectors, Finding
from server.guard.guardrails import Scorer, decide
from server.guard.metrics import GuardMetrics
from server.guard.texts import answer_slots, prompt_slots, rewrite

log = logging.getLogger("semcache.guard")


def blocked(direction: str, what: list[str]) -> ApiError:
    """The refusal of a prompt or an answer (the types or categories, never the values)."""
    names = ", ".join(sorted(set(what)))
    if direction == "prompt":
        return ApiError(
            400,
            f"Prompt blocked by the gateway's content rules ({names}).",
            code="prompt_blocked",
        )
    return ApiError(
        400, f"Response blocked by the gateway's content rules ({names}).", code="response_blocked"
    )


def _log_finding(kind: str, name: str, action: str, direction: str, ctx: RequestContext) -> None:
    """One line per finding on ``semcache.guard`` at level warning (the gateway's level):
    the type or category, the action, the direction and the request id, never the value."""
    log.warning(
        "guard: %s %s %s in the %s (request %s)", kind, name, action, direction, ctx.request_id
    )


@dataclass
class Verdict:
    """What the inspection of one text (or several) decided."""

    texts: list[str]
    """The texts, redacted where a rule says so."""
    findings: list[tuple[str, str]] = field(default_factory=list)
    """(entity type, action) of each finding, and (category, action) of each guardrail."""
    blocked: list[str] = field(default_factory=list)

    def header(self) -> str:
        seen: dict[str, str] = {}
        for name, action in self.findings:
            if action != "pass" and ACTION_RANK.get(action, 0) >= ACTION_RANK.get(
                seen.get(name, "off"), 0
            ):
                seen[name] = action
        return ", ".join(f"{k}={v}" for k, v in sorted(seen.items()))


@dataclass
class Inspection:
    """The rule that applies to one request, for the answer's side."""

    guard: Guard
    policy: Policy
    rule: GuardRule

    @property
    def answers(self) -> bool:
        rails = self.rule.guardrails
        return bool(self.rule.answer or (rails.model and rails.answer))

    async def answer(
        self, route: str, raw: bytes, ctx: RequestContext
    ) -> tuple[bytes, dict[str, str]]:
        if not self.answers:
            return raw, {}
        return await self.guard.answer(self.policy, self.rule, route, raw, ctx)


class Guard:
    """One per gateway: the detectors of the current policy and the guardrails' scorer."""

    def __init__(self, metrics: GuardMetrics, scorer: Scorer) -> None:
        self.metrics = metrics
        self.scorer = scorer
        self._detectors: tuple[GuardSettings, Detectors] | None = None
        self._building: asyncio.Lock | None = None

    def rule(self, policy: Policy, model_id: str, route: str, ctx: RequestContext) -> GuardRule:
        if not policy.guarded:
            return NO_GUARD
        return policy.guard_rule(policy.rule(model_id, route), ctx.tenant, ctx.token_id)

    def check_models(self, policy: Policy) -> str | None:
        """Why a guardrail model of ``policy`` cannot score, or ``None``."""
        rules = (policy.defaults, *policy.route_rules.values(), *policy.model_rules.values())
        patches = (*policy.guard.tenants.values(), *policy.guard.keys.values())
        models = {r.guardrails.model for r in rules} | {
            p.get("guardrails", {}).get("model") for p in patches
        }
        for model in sorted(m for m in models if m):
            problem = self.scorer.check(model)
            if problem is not None:
                return f"{policy.source}: guardrails.model: {problem}"
        return None

    async def begin(
        self, policy: Policy, model_id: str, route: str, body: dict[str, Any], ctx: RequestContext
    ) -> tuple[dict[str, Any], dict[str, str], Inspection | None]:
        """A request's prompt inspected: the body to send on, the headers naming what was
        found, and what applies to its answer (``None``: no rule applies, nothing to do)."""
        rule = self.rule(policy, model_id, route, ctx)
        if not rule.active:
            return body, {}, None
        body, headers = await self.prompt(policy, rule, route, body, ctx)
        return body, headers, Inspection(self, policy, rule)

    async def warm(self, policy: Policy) -> None:
        """Build the policy's detectors now (seconds: Presidio and spaCy import), off the loop."""
        if policy.guarded:
            await self.detectors(policy.guard)

    async def detectors(self, settings: GuardSettings) -> Detectors:
        held = self._detectors
        if held is not None and held[0] == settings:
            return held[1]
        if self._building is None:
            self._building = asyncio.Lock()
        async with self._building:
            held = self._detectors
            if held is None or held[0] != settings:
                built = await asyncio.to_thread(Detectors, settings)
                self._detectors = held = (settings, built)
        return held[1]

    async def inspect(
        self,
        policy: Policy,
        rule: GuardRule,
        direction: str,
        texts: list[str],
        ctx: RequestContext,
    ) -> Verdict:
        """Detect, redact and score ``texts`` (one prompt's, or one answer's) under ``rule``."""
        started = time.perf_counter()
        entities = rule.prompt if direction == "prompt" else rule.answer
        verdict = Verdict(list(texts))
        if entities:
            detectors = await self.detectors(policy.guard)
            for i, text in enumerate(texts):
                found = await detectors.find_async(text, entities)
                self._note(verdict, found, entities, direction, ctx)
                to_redact = [f for f in found if entities[f.entity] == "redact"]
                verdict.texts[i] = detectors.redact(text, to_redact)
        rails = rule.guardrails
        categories = rails.prompt if direction == "prompt" else rails.answer
        if rails.model and categories and not verdict.blocked and any(texts):
            scores = await self.scorer.score(rails.model, "\n".join(verdict.texts), ctx)
            for category, action in decide(scores, categories).items():
                self.metrics.decisions.labels(category, action, direction).inc()
                if action != "pass":
                    _log_finding("guardrail", category, action, direction, ctx)
                verdict.findings.append((category, action))
                if action == "block":
                    verdict.blocked.append(category)
        ended = time.perf_counter()
        self.metrics.duration.labels(direction).observe(ended - started)
        ctx.usage.inspected = True
        ctx.usage.findings += [f"{direction}:{n}:{a}" for n, a in verdict.findings if a != "pass"]
        spans.record_span(
            f"guard.{direction}",
            started,
            ended,
            {
                "semcache.guard.findings": len(verdict.findings),
                "semcache.guard.types": verdict.header(),
                "semcache.guard.blocked": bool(verdict.blocked),
            },
        )
        return verdict

    def counted(self, entity: str, action: str, direction: str, ctx: RequestContext) -> None:
        """One finding of the detectors: its metric and its log line (never the value)."""
        self.metrics.findings.labels(entity, action, direction).inc()
        _log_finding("dlp", entity, action, direction, ctx)

    def _note(
        self,
        verdict: Verdict,
        found: list[Finding],
        entities: Mapping[str, str],
        direction: str,
        ctx: RequestContext,
    ) -> None:
        for f in found:
            action = entities[f.entity]
            self.counted(f.entity, action, direction, ctx)
            verdict.findings.append((f.entity, action))
            if action == "block":
                verdict.blocked.append(f.entity)

    async def prompt(
        self,
        policy: Policy,
        rule: GuardRule,
        route: str,
        body: dict[str, Any],
        ctx: RequestContext,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The body to send on (redacted where the rule says) and the headers naming what
        was found; a block raises the route's 400."""
        slots = prompt_slots(route, body)
        texts = [container[key] for container, key in slots]
        verdict = await self.inspect(policy, rule, "prompt", texts, ctx)
        if verdict.blocked:
            raise blocked("prompt", verdict.blocked)
        if verdict.texts != texts:
            body = rewrite(body, lambda b: prompt_slots(route, b), verdict.texts)
        said = verdict.header()
        return body, ({"x-semcache-dlp-prompt": said} if said else {})

    async def answer(
        self, policy: Policy, rule: GuardRule, route: str, raw: bytes, ctx: RequestContext
    ) -> tuple[bytes, dict[str, str]]:
        """A whole JSON answer, redacted where the rule says; a block raises the 400."""
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw, {}
        if not isinstance(answer, dict):
            return raw, {}
        slots = answer_slots(route, answer)
        texts = [container[key] for container, key in slots]
        verdict = await self.inspect(policy, rule, "answer", texts, ctx)
        if verdict.blocked:
            raise blocked("answer", verdict.blocked)
        said = verdict.header()
        headers = {"x-semcache-dlp-answer": said} if said else {}
        if verdict.texts == texts:
            return raw, headers
        for (container, key), text in zip(slots, verdict.texts, strict=True):
            container[key] = text
        return orjson.dumps(answer), headers
