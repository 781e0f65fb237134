"""Every query of the Grafana dashboards (``deploy/grafana/*.json``) names metrics the
gateway exports: the app's own ``/metrics``, read with a P/D backend configured so the
backend and pool families are there too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from backends.config import VllmBackendConfig, VllmServer
from harness.ports import free_port
from server.app import create_app
from server.config import GatewayConfig, ModelEntry

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "grafana").glob("*.json"))

SERIES_OF: dict[str, tuple[str, ...]] = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "unknown": ("",),
}
"""The series a family of each type exposes, by suffix."""

PROMQL_WORDS = {
    # aggregations, functions and keywords the dashboards may use
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev",
    "rate", "irate", "increase", "delta", "histogram_quantile", "scalar", "vector",
    "clamp_min", "clamp_max", "abs", "round", "time", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "offset", "bool", "le", "inf", "nan",
}  # fmt: skip
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{[^}]*\}")
RANGES = re.compile(r"\[[^\]]*\]")
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers, less the label
    matchers, ranges, grouping labels, string literals, functions and keywords."""
    text = STRINGS.sub(" ", expr)
    text = MATCHERS.sub(" ", text)
    text = RANGES.sub(" ", text)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables ($__range, $__rate_interval)
    names = set()
    for match in IDENTIFIER.finditer(text):
        word = match.group()
        following = text[match.end() :].lstrip()[:1]
        if word.lower() in PROMQL_WORDS or following == "(":
            continue
        names.add(word)
    return names


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name the gateway's ``/metrics`` exposes."""
    servers = [
        VllmServer(url=f"http://127.0.0.1:{free_port()}", role="prefill"),
        VllmServer(url=f"http://127.0.0.1:{free_port()}", role="decode"),
    ]
    backend = VllmBackendConfig(
        name="pd",
        served_model="m",
        revision="test",
        servers=servers,
        health_interval_s=3600,
        cache_salt_secret="s",
    )
    config = GatewayConfig(
        data_dir=str(tmp_path_factory.mktemp("metrics")),
        models=[ModelEntry(id="chat", backend="pd")],
        backends=[backend],
    )
    with TestClient(create_app(config)) as client:
        text = client.get("/metrics").text
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SERIES_OF[family.type])
    return names


def test_the_dashboards_are_there() -> None:
    assert {p.name for p in DASHBOARDS} >= {
        "semcache-cache.json",
        "semcache-traffic.json",
        "semcache-backends.json",
    }


def test_the_expression_reader_finds_the_metrics() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, route) (rate(a_bucket{route="x"}[5m])))'
        " / scalar(sum(b_total) + c)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_exported_metrics(path: Path, exported: set[str]) -> None:
    dashboard = json.loads(path.read_text())
    unknown: dict[str, set[str]] = {}
    found = list(expressions(dashboard))
    assert found, f"{path.name} has no query"
    for title, expr in found:
        names = metric_names(expr)
        assert names, f"{path.name}: {title!r} reads no metric: {expr}"
        if missing := names - exported:
            unknown[title] = missing
    assert not unknown, f"{path.name}: metrics the gateway does not export: {unknown}"
