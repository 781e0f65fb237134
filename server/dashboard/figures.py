"""The gateway's Prometheus registry read into the plain figures the dashboard shows.

Everything here comes from the same registry as ``/metrics``, so a figure on a page and the
matching line of ``/metrics`` never disagree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, list[tuple[dict[str, str], float]]]

LATENCY = "semcache_request_duration_seconds"
OUTCOMES = "semcache_request_cache_outcomes_total"
TTFT = "semcache_time_to_first_byte_seconds"


REQUESTS = "semcache_requests_total"
TENANT_REQUESTS = "semcache_tenant_requests_total"


def read_samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry, by sample name (``x_total``, ``x_bucket``, ...).

    With ``[request_log] tenant_metrics`` the requests are counted per tenant instead of in
    ``semcache_requests``: the pages read them as ``semcache_requests``, summed over tenants.
    """
    out: Samples = defaultdict(list)
    for family in registry.collect():
        for sample in family.samples:
            out[sample.name].append((sample.labels, sample.value))
    if TENANT_REQUESTS in out:
        merged: dict[Labels, float] = defaultdict(float)
        for labels, value in [*out.pop(REQUESTS, []), *out.pop(TENANT_REQUESTS)]:
            merged[tuple(sorted((k, v) for k, v in labels.items() if k != "tenant"))] += value
        out[REQUESTS] = [(dict(labels), value) for labels, value in merged.items()]
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of a family's samples whose labels include ``match``."""
    return sum(
        value
        for labels, value in samples.get(name, ())
        if all(labels.get(k) == v for k, v in match.items())
    )


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """A family's samples summed per value of one label."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, ()):
        out[labels.get(label, "")] += value
    return dict(out)


def buckets(samples: Samples, histogram: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts (``le`` → count), summed over its labels."""
    return by_label(samples, f"{histogram}_bucket", "le")


def quantile(cumulative: Mapping[str, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative buckets, interpolated inside its bucket as Prometheus'
    ``histogram_quantile`` does; ``None`` without observations."""
    edges = sorted((float(le), n) for le, n in cumulative.items())
    if not edges or edges[-1][1] <= 0:
        return None
    rank = q * edges[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in edges:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bucket: its bound, as Prometheus does
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return None


def overview_totals(samples: Samples) -> dict[str, float]:
    """The cumulative counters the overview's rates and ratios are made of. Hits and misses
    are requests by their one cache outcome (``semcache_request_cache_outcomes_total``), not
    the exact tier's lookups, which count each item of a pooling request."""
    requests = total(samples, REQUESTS)

    def outcome(*names: str) -> float:
        return sum(total(samples, OUTCOMES, outcome=name) for name in names)

    exact = outcome("exact", "stale")
    semantic = outcome("semantic")
    figures = {
        "requests": requests,
        "exact_hits": exact,
        "semantic_hits": semantic,
        "misses": outcome("miss", "partial"),  # a partial answer is no hit
        "tokens_saved": total(samples, "semcache_exact_tokens_saved_total"),
        "usd_saved": total(samples, "semcache_exact_usd_saved_total"),
        "backend_tokens": total(samples, "semcache_tokens_total"),
        "backend_errors": total(samples, "semcache_backend_errors_total"),
    }
    for status, n in by_label(samples, REQUESTS, "status").items():
        figures[f"status_{status}"] = n
    return figures


def histogram_state(samples: Samples) -> dict[str, dict[str, float]]:
    """The latency and TTFT histograms' cumulative buckets."""
    return {"latency": buckets(samples, LATENCY), "ttft": buckets(samples, TTFT)}


def _server_key(labels: Mapping[str, str]) -> tuple[str, str, str]:
    return labels.get("backend", ""), labels.get("server", ""), labels.get("role", "")


def backend_servers(samples: Samples) -> list[dict[str, object]]:
    """One row per vLLM server: health, load, errors, and its own prefix-cache counters."""
    rows: dict[tuple[str, str, str], dict[str, object]] = {}
    fields = {
        "semcache_backend_server_healthy": "healthy",
        "semcache_backend_server_inflight": "inflight",
        "semcache_backend_server_limit": "limit",
        "semcache_backend_server_requests_total": "requests",
        "semcache_backend_server_errors_total": "errors",
        "semcache_backend_server_ejections_total": "ejections",
        "semcache_upstream_vllm_prefix_cache_queries_total": "prefix_queries",
        "semcache_upstream_vllm_prefix_cache_hits_total": "prefix_hits",
        "semcache_upstream_vllm_num_requests_running": "vllm_running",
        "semcache_upstream_vllm_num_requests_waiting": "vllm_waiting",
        "semcache_upstream_vllm_kv_cache_usage_perc": "kv_usage",
    }
    for name, field in fields.items():
        for labels, value in samples.get(name, ()):
            key = _server_key(labels)
            row = rows.setdefault(
                key, {"backend": key[0], "server": key[1], "role": key[2], "errors": 0.0}
            )
            row[field] = float(row.get(field, 0.0)) + value  # type: ignore[arg-type]
    for row in rows.values():
        queries, hits = row.get("prefix_queries"), row.get("prefix_hits")
        row["prefix_hit_rate"] = (
            hits / queries
            if isinstance(queries, float) and isinstance(hits, float) and queries > 0
            else None
        )
    return sorted(
        rows.values(), key=lambda r: (str(r["backend"]), str(r["role"]), str(r["server"]))
    )


def _row_order(row: Mapping[str, object]) -> tuple[str, str, str]:
    return str(row["backend"]), str(row["role"]), str(row["server"])


def backend_pools(samples: Samples) -> list[dict[str, object]]:
    """One row per backend: queue, refusals, P/D hops, prefill hops skipped by reason and
    the KV hand-off latency."""
    names = {labels.get("backend", "") for labels, _ in samples.get("semcache_pd_hops_total", ())}
    names |= {
        labels.get("backend", "") for labels, _ in samples.get("semcache_backend_queue_waiting", ())
    }
    rows = []
    for backend in sorted(names):
        count = total(samples, "semcache_pd_kv_handoff_seconds_count", backend=backend)
        seconds = total(samples, "semcache_pd_kv_handoff_seconds_sum", backend=backend)
        handoff = {
            le: n
            for labels, n in samples.get("semcache_pd_kv_handoff_seconds_bucket", ())
            if labels.get("backend") == backend
            for le in (labels["le"],)
        }
        rows.append(
            {
                "backend": backend,
                "waiting": total(samples, "semcache_backend_queue_waiting", backend=backend),
                "refused": total(samples, "semcache_backend_refused_total", backend=backend),
                "hops": {
                    hop: n
                    for labels, n in samples.get("semcache_pd_hops_total", ())
                    if labels.get("backend") == backend
                    for hop in (labels["hop"],)
                },
                "skipped": {
                    reason: n
                    for labels, n in samples.get("semcache_pd_prefill_skipped_total", ())
                    if labels.get("backend") == backend
                    for reason in (labels["reason"],)
                },
                "handoffs": count,
                "handoff_mean_s": seconds / count if count else None,
                "handoff_p99_s": quantile(handoff, 0.99),
            }
        )
    return rows


def kv_placement(samples: Samples) -> list[dict[str, object]]:
    """One row per backend and pool role that KV placement ranked: the prefix-cache hit rate
    it predicted (tokens the chosen server held / prompt tokens) next to the one vLLM
    counted on that pool's servers, its decisions by reason, and the index size."""
    ranked = samples.get("semcache_kv_ranked_prompt_tokens_total", ())
    rows: list[dict[str, object]] = []
    for backend, role in sorted({(k.get("backend", ""), k.get("role", "")) for k, _ in ranked}):
        pool = {"backend": backend, "role": role}
        prompt = total(samples, "semcache_kv_ranked_prompt_tokens_total", **pool)
        predicted = total(samples, "semcache_kv_predicted_cached_tokens_total", **pool)
        queries = total(samples, "semcache_upstream_vllm_prefix_cache_queries_total", **pool)
        hits = total(samples, "semcache_upstream_vllm_prefix_cache_hits_total", **pool)
        rows.append(
            {
                **pool,
                "predicted_hit_rate": predicted / prompt if prompt else None,
                "realised_hit_rate": hits / queries if queries else None,
                "decisions": {
                    labels["reason"]: n
                    for labels, n in samples.get("semcache_kv_placement_decisions_total", ())
                    if labels.get("backend") == backend and labels.get("role") == role
                },
                "index_blocks": total(samples, "semcache_kv_index_blocks", backend=backend),
                "index_evicted": total(samples, "semcache_kv_index_evicted_total", backend=backend),
            }
        )
    return rows


def fair_queue(samples: Samples) -> dict[str, list[dict[str, object]]]:
    """The pools' fair wait queues: per band, how many waited and for how long; per band
    and tenant, how many wait now and how many were refused, by reason."""
    waits: list[dict[str, object]] = []
    counted = samples.get("semcache_queue_wait_seconds_count", ())
    for pool, band in sorted({(k.get("pool", ""), k.get("band", "")) for k, _ in counted}):
        key = {"pool": pool, "band": band}
        count = total(samples, "semcache_queue_wait_seconds_count", **key)
        cumulative = {
            labels["le"]: n
            for labels, n in samples.get("semcache_queue_wait_seconds_bucket", ())
            if labels.get("pool") == pool and labels.get("band") == band
        }
        waits.append(
            {
                **key,
                "waited": count,
                "wait_mean_s": total(samples, "semcache_queue_wait_seconds_sum", **key) / count
                if count
                else None,
                "wait_p99_s": quantile(cumulative, 0.99),
            }
        )
    tenants: dict[tuple[str, str, str], dict[str, object]] = {}

    def row(labels: Mapping[str, str]) -> dict[str, object]:
        key = (labels.get("pool", ""), labels.get("band", ""), labels.get("tenant", ""))
        if key not in tenants:
            tenants[key] = dict(zip(("pool", "band", "tenant"), key, strict=True))
            tenants[key].update(depth=0.0, rejected={})
        return tenants[key]

    for labels, n in samples.get("semcache_queue_depth", ()):
        row(labels)["depth"] = n
    for labels, n in samples.get("semcache_queue_rejected_total", ()):
        rejected = row(labels)["rejected"]
        assert isinstance(rejected, dict)
        rejected[labels.get("reason", "")] = n
    return {"bands": waits, "tenants": [tenants[k] for k in sorted(tenants)]}


def labelled_rows(samples: Samples, name: str, labels: Iterable[str]) -> list[dict[str, object]]:
    """A family's samples as rows of their labels and value."""
    keys = list(labels)
    return [
        {**{k: sample_labels.get(k, "") for k in keys}, "value": value}
        for sample_labels, value in samples.get(name, ())
    ]


def content_findings(samples: Samples) -> list[dict[str, object]]:
    """The DLP findings and guardrail decisions (``pass`` left out), one row per direction,
    type or category, and action: what the content rules did since the start."""
    rows: list[dict[str, object]] = []
    for family, name_label, kind in (
        ("semcache_dlp_findings_total", "entity", "dlp"),
        ("semcache_guardrail_decisions_total", "category", "guardrail"),
    ):
        for labels, n in samples.get(family, ()):
            if labels.get("action") != "pass" and n:
                rows.append(
                    {
                        "kind": kind,
                        "direction": labels.get("direction", ""),
                        "name": labels.get(name_label, ""),
                        "action": labels.get("action", ""),
                        "count": n,
                    }
                )
    return sorted(rows, key=lambda r: (str(r["direction"]), str(r["name"]), str(r["action"])))
