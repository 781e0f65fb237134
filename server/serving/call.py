"""One generation request on its way to a backend, and what it reports to the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from backends.interfaces import GenerationBackend
from backends.registry import ModelInfo
from foundation.request import RequestContext
from server.guard.inspector import Inspection
from server.metrics import GatewayMetrics
from server.serving.output_limit import NO_LIMIT, OutputLimit
from server.serving.usage_notes import tokens_of


@dataclass
class GenerationCall:
    """One generation request on its way to a backend."""

    path: str
    route: str
    info: ModelInfo
    backend: GenerationBackend
    upstream: dict[str, Any]
    """The body sent to the backend: the client's, with ``model`` set to the served name."""
    ctx: RequestContext
    started: float
    metrics: GatewayMetrics
    inspection: Inspection | None = None
    """The DLP and guardrail rule that applies to the answer (``None``: none)."""
    output_limit: OutputLimit = NO_LIMIT
    """What bounds the answer, which its usage says (``output_limit``)."""

    def backend_failed(self, kind: str) -> None:
        self.metrics.backend_errors.labels(self.backend.name, kind).inc()

    def observe_latency(self, *, stream: bool) -> None:
        elapsed = time.perf_counter() - self.started
        self.metrics.latency.labels(self.route, "true" if stream else "false").observe(elapsed)

    def observe_ttft(self) -> None:
        self.metrics.ttft.labels(self.route).observe(time.perf_counter() - self.started)

    def count_usage(self, usage: dict[str, Any] | None) -> None:
        self.metrics.count_usage(self.info.id, usage)
        self.ctx.usage.add(*tokens_of(usage))
