"""Guardrails: a classification model of the registry scores a text; each category at or
above its threshold takes its action."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from backends.registry import ModelRegistry
from foundation.request import RequestContext
from semcache.guard_rules import Threshold
from server.errors import ApiError

EncoderSource = Callable[[], Awaitable[object]]
"""The semantic cache's encoder, which the embedded classifier runs on."""


class Scorer:
    """Scores texts with any ``task = "classification"`` model: the embedded classifier or
    a vLLM pooling model (a safety model such as Llama Guard)."""

    def __init__(self, registry: ModelRegistry, encoder: EncoderSource) -> None:
        self.registry = registry
        self.encoder = encoder

    def check(self, model: str) -> str | None:
        """Why ``model`` cannot score (unknown, not a classifier), or ``None``."""
        info = self.registry.resolve(model)
        if info is None:
            return f"no model {model!r} in the gateway config"
        if info.task != "classification":
            return f"the model {model!r} serves {info.task}, not classification"
        return None

    async def score(self, model: str, text: str, ctx: RequestContext) -> dict[str, float]:
        """Every label's score for ``text``."""
        info = self.registry.resolve(model)
        if info is None or info.task != "classification":
            raise ApiError(503, f"The guardrail model `{model}` is unavailable.", code="guardrail")
        backend = self.registry.classifier_backend(info)
        if backend.uses_encoder:
            await backend.start(await self.encoder())  # type: ignore[arg-type]
        else:
            await backend.start()
        (scores,) = await backend.classify([text], ctx)
        return {label.lower(): score for label, score in scores}


def decide(scores: Mapping[str, float], categories: Mapping[str, Threshold]) -> dict[str, str]:
    """Per category: its action when its score reaches the threshold, else ``pass``."""
    out: dict[str, str] = {}
    for category, th in categories.items():
        hit = scores.get(category.lower(), 0.0) >= th.threshold and th.action != "off"
        out[category] = th.action if hit else "pass"
    return out
