"""The parts of a vLLM server's own ``/metrics`` page that the gateway copies.

The health checks scrape each server's page; ``parse_upstream_metrics`` keeps its prefix-cache,
KV, queue and time-to-first-token families (histograms as their ``_sum`` and ``_count`` only),
without vLLM's per-engine labels, for ``backends.fleet.pool_metrics.BackendCollector`` to re-expose
and ``backends.fleet.pool_signals`` to read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_SCRAPED_FAMILIES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
)
_SCRAPED_PREFIXES = ("vllm:nixl_",)
"""Histograms of these families are copied as their ``_sum`` and ``_count`` only."""
_DROPPED_LABELS = frozenset({"engine", "model_name"})


@dataclass(frozen=True)
class UpstreamSample:
    """One sample of a server's own ``/metrics`` page, as last scraped."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    counter: bool


def _scraped(family: str) -> bool:
    return family in _SCRAPED_FAMILIES or family.startswith(_SCRAPED_PREFIXES)


def _kept_lines(text: str) -> str:
    """The page's lines that can belong to a scraped family, histogram buckets left out.

    Buckets are most of vLLM's page; dropping them (and the other families) before the
    parser, which is slow Python, makes a scrape cheap. The parser still picks the families.
    """
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.endswith("_bucket"):
                continue
        if name.startswith(_SCRAPED_FAMILIES + _SCRAPED_PREFIXES):
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def parse_upstream_metrics(text: str) -> list[UpstreamSample]:
    """The samples of a vLLM ``/metrics`` page that the gateway re-exposes."""
    return samples_of(text_string_to_metric_families(_kept_lines(text)))


def samples_of(families: Iterable[Metric]) -> list[UpstreamSample]:
    """The scraped samples among parsed ``families``."""
    out: list[UpstreamSample] = []
    for family in families:
        if not _scraped(family.name):
            continue
        histogram = family.type == "histogram"
        for sample in family.samples:
            if histogram and not sample.name.endswith(("_sum", "_count")):
                continue
            if sample.name.endswith("_created"):
                continue
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in _DROPPED_LABELS)
            )
            out.append(UpstreamSample(sample.name, labels, sample.value, family.type == "counter"))
    return out
