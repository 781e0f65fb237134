"""Prometheus metrics of the HTTP surface, on a registry owned by the app (no globals)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from semcache.metrics import Labelled

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


_USAGE_NAMES = (
    ("prompt", "prompt_tokens", "input_tokens"),
    ("completion", "completion_tokens", "output_tokens"),
)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Labelled(
            Counter(
                "semcache_requests",
                "HTTP requests by route, model and status code.",
                ["route", "model", "status"],
                registry=registry,
            )
        )
        self.tenant_requests = Labelled(
            Counter(
                "semcache_tenant_requests",
                "HTTP requests by tenant, route, model and status code "
                "(only with `[request_log] tenant_metrics = true`).",
                ["tenant", "route", "model", "status"],
                registry=registry,
            )
        )
        self.cache_outcomes = Labelled(
            Counter(
                "semcache_request_cache_outcomes",
                "Ended requests by route, model and cache outcome (none, miss, exact, stale, "
                "semantic, partial, bypass): the value the ledger, the limits and the request "
                "log read.",
                ["route", "model", "outcome"],
                registry=registry,
            )
        )
        self.latency = Labelled(
            Histogram(
                "semcache_request_duration_seconds",
                "Time to the complete answer, by route.",
                ["route", "stream"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self.early_hits = Labelled(
            Counter(
                "semcache_early_hits",
                "Exact hits answered before routing (a byte-identical repeat of a cached "
                "request; server/hit_shortcut.py), by route.",
                ["route"],
                registry=registry,
            )
        )
        self.ttft = Labelled(
            Histogram(
                "semcache_time_to_first_byte_seconds",
                "Time to the first relayed byte of a streamed answer.",
                ["route"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self.backend_errors = Labelled(
            Counter(
                "semcache_backend_errors",
                "Failed backend calls by backend and kind.",
                ["backend", "kind"],
                registry=registry,
            )
        )
        self.backend_calls = Labelled(
            Counter(
                "semcache_backend_calls",
                "Calls to a pooling backend (embeddings, classification, rerank scores: one "
                "batch of the inputs no cache answered) or to a model's tokenizer, by backend "
                "and route.",
                ["backend", "route"],
                registry=registry,
            )
        )
        self.backend_inputs = Labelled(
            Counter(
                "semcache_backend_inputs",
                "Inputs (texts, or query-document pairs for rerank) sent to a pooling backend "
                "or a tokenizer, by backend and route: what the caches did not answer.",
                ["backend", "route"],
                registry=registry,
            )
        )
        self.tokens = Labelled(
            Counter(
                "semcache_tokens",
                "Tokens in backend answers, by model and kind (prompt/completion).",
                ["model", "kind"],
                registry=registry,
            )
        )

        self.semantic_hits = Labelled(
            Counter(
                "semcache_semantic_hits",
                "Requests answered wholly (every item) from semantic matches, by model and route.",
                ["model", "route"],
                registry=registry,
            )
        )

        self.semantic_verified = Labelled(
            Counter(
                "semcache_semantic_verified",
                "Verified chat semantic cache decisions by model and event: exploit (served), "
                "explore (sent to the backend and judged), judged_right and judged_wrong (an "
                "explore whose cached answer was judged right, or wrong), capped (an explore "
                "over the per-minute cap, sent to the backend unjudged), unjudged (an "
                "explore the judge gave no verdict on: a judge model that failed or did not "
                "answer yes or no).",
                ["model", "event"],
                registry=registry,
            )
        )

    def count_usage(self, model: str, usage: Mapping[str, object] | None) -> None:
        if not usage:
            return
        # the Responses API names them input_tokens and output_tokens
        for kind, name, alias in _USAGE_NAMES:
            value = usage.get(name, usage.get(alias))
            if isinstance(value, int) and value > 0:
                self.tokens.labels(model, kind).inc(value)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        """``count_usage`` of usage already read (e.g. a stored answer's)."""
        if prompt > 0:
            self.tokens.labels(model, "prompt").inc(prompt)
        if completion > 0:
            self.tokens.labels(model, "completion").inc(completion)

    def count_backend_call(self, backend: str, route: str, inputs: int) -> None:
        """One call of a pooling backend on ``inputs`` texts."""
        self.backend_calls.labels(backend, route).inc()
        self.backend_inputs.labels(backend, route).inc(inputs)
