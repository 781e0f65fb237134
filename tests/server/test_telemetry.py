"""When tracing is on, where spans go and how they are sampled: the config and ``OTEL_*``."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased

from server.cli.backends import launcher
from server.config import ConfigError, parse_config
from server.telemetry import (
    DEFAULT_ENDPOINT,
    TracingSettings,
    build_tracing,
    traces_endpoint,
    tracing_on,
    vllm_traces_endpoint,
)

COLLECTOR = "http://collector:4318/v1/traces"


def test_off_by_default() -> None:
    settings = parse_config({}).tracing
    assert not tracing_on(settings, {})
    assert build_tracing(settings, {}) is None
    assert vllm_traces_endpoint(settings, {}) is None


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": COLLECTOR},
        {"OTEL_TRACES_EXPORTER": "otlp"},
    ],
)
def test_the_standard_environment_turns_it_on(environ: dict[str, str]) -> None:
    settings = TracingSettings()
    assert tracing_on(settings, environ)
    expected = DEFAULT_ENDPOINT if "OTEL_TRACES_EXPORTER" in environ else COLLECTOR
    assert traces_endpoint(settings, environ) == expected
    assert vllm_traces_endpoint(settings, environ) == expected


@pytest.mark.parametrize(
    "environ", [{"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}]
)
def test_the_standard_environment_keeps_it_off(environ: dict[str, str]) -> None:
    settings = TracingSettings(endpoint=COLLECTOR)
    assert not tracing_on(settings, {**environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"})


def test_one_config_setting_turns_it_on_with_its_ratio_and_name() -> None:
    cfg = parse_config(
        {"tracing": {"endpoint": COLLECTOR, "sample_ratio": 0.1, "service_name": "gw-1"}}
    )
    tracing = build_tracing(cfg.tracing, {})
    assert tracing is not None
    provider = tracing.provider
    assert isinstance(provider, TracerProvider)
    assert isinstance(provider.sampler, ParentBased)
    assert "0.1" in provider.sampler.get_description()
    assert provider.resource.attributes["service.name"] == "gw-1"
    assert vllm_traces_endpoint(cfg.tracing, {}) == COLLECTOR
    tracing.close()
    off = TracingSettings(endpoint=COLLECTOR, launched_vllm=False)
    assert vllm_traces_endpoint(off, {}) is None


@pytest.mark.parametrize(
    "bad", [{"sample_ratio": 1.5}, {"sample_ratio": -0.1}, {"endpoint": 3}, {"ratio": 0.5}]
)
def test_a_bad_setting_is_refused_at_load(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="tracing"):
        parse_config({"tracing": bad})


def test_semcache_serve_launches_vllm_with_the_endpoint_while_tracing_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    on = parse_config({"tracing": {"endpoint": COLLECTOR}})
    assert launcher(on).traces_endpoint == COLLECTOR  # what `serve` and `backends up` start
    assert launcher(parse_config({})).traces_endpoint is None
    kept = parse_config({"tracing": {"endpoint": COLLECTOR, "launched_vllm": False}})
    assert launcher(kept).traces_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert launcher(parse_config({})).traces_endpoint == COLLECTOR
