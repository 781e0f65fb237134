"""Gateway configuration: one TOML file, decoded into typed structs and validated once."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from backends.config import BackendConfig, VllmBackendConfig
from foundation.package_files import package_file
from semcache.ledger.settings import LedgerSettings
from server.batch.settings import BatchSettings
from server.envelope.queue_tickets import QueueSettings
from server.envelope.request_log import RequestLogSettings
from server.identity.api_keys.settings import KeySettings
from server.identity.auth import AuthSettings
from server.limits.settings import LimitSettings
from server.pools.settings import MembershipSettings
from server.telemetry import TracingSettings

Task = Literal["chat", "embeddings", "classification", "rerank"]
"""``rerank``: a cross-encoder (one score per query and document: ``/v1/score``,
``/v1/rerank``), served by a vLLM backend of task ``classify`` (its pooling runner)."""
POOLING_TASKS = ("classification", "rerank")


class ConfigError(Exception):
    """A configuration file is missing, unreadable or invalid; the message names the field."""


class ServerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 10 * 1024 * 1024
    ready_timeout_s: float = 900.0
    """How long `semcache serve` waits for launched backends to become healthy."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long requests in flight may take to finish (server/http/draining.py)."""
    early_hits: bool = True
    """Answer byte-identical repeats of cached requests before routing
    (server/envelope/early_hits.py); false sends every request through its route."""


class DebugSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    adjustable_clock: bool = False
    """``GET``/``POST /admin/debug/clock``: an admin moves or freezes the gateway's calendar
    clock (cache ages and TTLs, budget periods, ledger days). For staging and tests, never
    production: a moved clock expires or revives every cached answer at once."""


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One model the gateway exposes: an OpenAI id, Workers-AI aliases and its backend."""

    id: str
    backend: str
    task: Task = "chat"
    aliases: list[str] = msgspec.field(default_factory=list)
    owned_by: str = "semcache"


ENCODER_DIR_ENV = "SEMCACHE_ENCODER_DIR"


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    data_dir: str = ".data"
    encoder_dir: str | None = None
    """Where encoders' exported ONNX graphs are kept; default ``$SEMCACHE_ENCODER_DIR``, else
    ``<data_dir>/encoders``. Gateways on one host can share one: each graph is exported once."""
    policy: str | None = None
    """Cache policy file; default: the embedded ``policies/default.toml``."""
    cache: bool = True
    """False serves every request from the backends (the policy is still validated)."""
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    models: list[ModelEntry] = msgspec.field(default_factory=list)
    backends: list[BackendConfig] = msgspec.field(default_factory=list)
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)
    """API tokens of every route and the tenants they belong to (server/identity/auth.py)."""
    request_log: RequestLogSettings = msgspec.field(default_factory=RequestLogSettings)
    """One JSON line per request (server/envelope/request_log.py)."""
    batch: BatchSettings = msgspec.field(default_factory=BatchSettings)
    """Asynchronous batches (Workers AI ``queueRequest``): the queue and its workers."""
    limits: LimitSettings = msgspec.field(default_factory=LimitSettings)
    """Default rate limits and budgets of every token (a token entry may override them)."""
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    """How requests wait for a full pool: bands, fair shares (server/envelope/queue_tickets.py)."""
    ledger: LedgerSettings = msgspec.field(default_factory=LedgerSettings)
    """The usage and cost ledger: SQLite under the data dir, or Redis counters."""
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
    """OpenTelemetry traces of every request (server/telemetry.py); off by default."""
    keys: KeySettings = msgspec.field(default_factory=KeySettings)
    """API keys made through the admin API: their store and hash (server/identity/api_keys/)."""
    pools: MembershipSettings = msgspec.field(default_factory=MembershipSettings)
    """Where servers added and drained at run time are kept (server/membership/)."""
    debug: DebugSettings = msgspec.field(default_factory=DebugSettings)
    """Tools for staging gateways and tests; all off by default."""

    def data_path(self) -> Path:
        """The data directory (prepared models, disk cache), created on demand."""
        return Path(os.path.expanduser(self.data_dir)).resolve()

    def encoder_path(self) -> Path:
        """The folder of exported encoder graphs (see ``encoder_dir``)."""
        chosen = self.encoder_dir or os.environ.get(ENCODER_DIR_ENV)
        if chosen:
            return Path(os.path.expanduser(chosen)).resolve()
        return self.data_path() / "encoders"

    def backend(self, name: str) -> BackendConfig:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)


DEFAULT_CONFIG = package_file("server", "configs", "default.toml")
"""The embedded default (package data: ``server/configs/``, beside two examples)."""


def _check(cfg: GatewayConfig, source: str) -> None:
    names = [b.name for b in cfg.backends]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{source}: backends: duplicate name(s) {sorted(dup)}")
    seen: dict[str, str] = {}
    for i, m in enumerate(cfg.models):
        if m.backend not in names:
            raise ConfigError(
                f"{source}: models[{i}].backend: unknown backend {m.backend!r}; "
                f"expected one of {names}"
            )
        backend = cfg.backend(m.backend)
        if isinstance(backend, VllmBackendConfig) and (m.task in POOLING_TASKS) != (
            backend.task == "classify"
        ):
            raise ConfigError(
                f"{source}: models[{i}].task: {m.task!r} on vLLM backend {m.backend!r} "
                f"of task {backend.task!r}; a classification (or rerank) model needs a vLLM "
                'backend with task = "classify", and such a backend serves classification only '
                "(or rerank: a one-label cross-encoder)"
            )
        if m.task == "rerank" and not isinstance(backend, VllmBackendConfig):
            raise ConfigError(
                f"{source}: models[{i}].task: a rerank model needs a vLLM backend "
                '(task = "classify": a cross-encoder with one label)'
            )
        for name in (m.id, *m.aliases):
            if name in seen:
                raise ConfigError(
                    f"{source}: models[{i}]: name {name!r} already used by model {seen[name]!r}"
                )
            seen[name] = m.id


def parse_config(data: dict[str, object], source: str = "<config>") -> GatewayConfig:
    """Validate a decoded TOML document; errors name the source and the field path."""
    try:
        cfg = msgspec.convert(data, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _check(cfg, source)
    return cfg


def load_config(path: str | Path | None = None) -> GatewayConfig:
    """Load the gateway config from ``path`` (default: the embedded :data:`DEFAULT_CONFIG`)."""
    p = Path(path) if path else DEFAULT_CONFIG
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    return parse_config(data, str(p))
