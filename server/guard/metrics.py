"""Prometheus metrics of the inspection steps (entity types and categories as labels, never
a detected value)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from semcache.metrics import Labelled

_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.findings = Labelled(
            Counter(
                "semcache_dlp_findings",
                "Values the DLP detectors found, by entity type, the action taken and the "
                "direction (prompt or answer).",
                ["entity", "action", "direction"],
                registry=registry,
            )
        )
        self.decisions = Labelled(
            Counter(
                "semcache_guardrail_decisions",
                "Guardrail scorings, by category, the action taken (`pass` below the "
                "threshold) and the direction.",
                ["category", "action", "direction"],
                registry=registry,
            )
        )
        self.duration = Labelled(
            Histogram(
                "semcache_guard_duration_seconds",
                "Time the detectors and guardrails took on one prompt, one whole answer or "
                "one streamed chunk (`stream`).",
                ["direction"],
                buckets=_BUCKETS,
                registry=registry,
            )
        )
