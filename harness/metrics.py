"""Reading values off a server's Prometheus ``/metrics`` page (vLLM's or the gateway's)."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_metric(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` (e.g. ``vllm:prefix_cache_hits_total``) in a
    Prometheus text page, over all label sets, or only those carrying ``labels``."""
    wanted = dict(labels or {})
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name:
                continue
            if all(sample.labels.get(key) == value for key, value in wanted.items()):
                total += sample.value
    return total


async def metric_value(
    base_url: str,
    name: str,
    labels: Mapping[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
) -> float:
    """``parse_metric`` on the live ``/metrics`` page of the server at ``base_url``."""
    url = f"{base_url.rstrip('/')}/metrics"
    if client is not None:
        response = await client.get(url)
    else:
        async with httpx.AsyncClient(timeout=10.0) as own:
            response = await own.get(url)
    response.raise_for_status()
    return parse_metric(response.text, name, labels)
