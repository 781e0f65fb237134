"""Tracing settings and the tracer provider the app factory builds from them.

Off by default. On with ``[tracing] endpoint = "http://collector:4318/v1/traces"`` in the
gateway config, or with the standard OpenTelemetry environment: an
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, or
``OTEL_TRACES_EXPORTER=otlp`` (or ``console``); ``OTEL_TRACES_EXPORTER=none`` and
``OTEL_SDK_DISABLED=true`` keep it off, as ``enabled = false`` does. Sampling:
``sample_ratio`` (parent-based: a client's sampled ``traceparent`` is always followed),
else ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` as the SDK reads them.
Spans leave through OTLP/HTTP (protobuf) from the SDK's batch processor thread, never from
the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

import msgspec
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from foundation.config_types import Unit
from foundation.tracing import Tracing

DEFAULT_SERVICE: Final = "semcache"
DEFAULT_ENDPOINT: Final = "http://localhost:4318/v1/traces"
"""Where OTLP/HTTP traces go when only ``OTEL_TRACES_EXPORTER=otlp`` turns tracing on."""


class TracingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[tracing]`` section of the gateway config."""

    enabled: bool | None = None
    """``None``: on when ``endpoint`` or the ``OTEL_*`` environment says so."""
    endpoint: str | None = None
    """The OTLP/HTTP traces URL (``…/v1/traces``); else the ``OTEL_EXPORTER_OTLP_*`` one."""
    sample_ratio: Unit | None = None
    """Share of new traces kept; ``None``: ``OTEL_TRACES_SAMPLER(_ARG)``, else all."""
    service_name: str | None = None
    """The gateway's ``service.name``; ``None``: ``OTEL_SERVICE_NAME``, else ``semcache``."""
    launched_vllm: bool = True
    """vLLM servers `semcache serve` launches export their spans to the same endpoint."""


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("OTEL_TRACES_EXPORTER", "")
    return [name.strip().lower() for name in raw.split(",") if name.strip()]


def tracing_on(settings: TracingSettings, environ: Mapping[str, str]) -> bool:
    """Whether the gateway traces requests under ``settings`` and ``environ``."""
    if settings.enabled is not None:
        return settings.enabled
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporter_names(environ)
    if "none" in names:
        return False
    return bool(
        settings.endpoint
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or names
    )


def traces_endpoint(settings: TracingSettings, environ: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL spans are sent to (as the SDK's exporter resolves it)."""
    if settings.endpoint:
        return settings.endpoint
    if found := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return found
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return base.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


def vllm_traces_endpoint(
    settings: TracingSettings, environ: Mapping[str, str] | None = None
) -> str | None:
    """The endpoint launched vLLM servers get (``--otlp-traces-endpoint``); ``None``: none."""
    env = os.environ if environ is None else environ
    if not settings.launched_vllm or not tracing_on(settings, env):
        return None
    names = _exporter_names(env)
    if names and "otlp" not in names:
        return None  # e.g. console only: nothing for vLLM to send to
    return traces_endpoint(settings, env)


def _sampler(settings: TracingSettings) -> Sampler | None:
    if settings.sample_ratio is None:
        return None  # the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG
    return ParentBased(TraceIdRatioBased(settings.sample_ratio))


def build_tracing(
    settings: TracingSettings,
    environ: Mapping[str, str] | None = None,
    *,
    exporter: SpanExporter | None = None,
) -> Tracing | None:
    """The gateway's tracing, or ``None`` when it is off. ``exporter`` (tests: an
    in-memory one) replaces the configured exporters and receives each span as it ends."""
    env = os.environ if environ is None else environ
    if exporter is None and not tracing_on(settings, env):
        return None
    service = settings.service_name or env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE
    provider = TracerProvider(
        sampler=_sampler(settings), resource=Resource.create({SERVICE_NAME: service})
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return Tracing(provider)
    names = _exporter_names(env) or ["otlp"]
    if "otlp" in names:
        otlp = OTLPSpanExporter(endpoint=traces_endpoint(settings, env))
        provider.add_span_processor(BatchSpanProcessor(otlp))
    if "console" in names:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return Tracing(provider)
