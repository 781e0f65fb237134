"""The two gateways, gw1 and gw2: one config but for the address and the data directory,
one policy, the shared tier as L3 and as the batch queue, p1 and d1 behind them."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cluster.processes import Service
from harness.cluster.topology import (
    GATEWAY_PORT,
    METERED_RPM,
    METERED_TOKEN,
    MODEL_ID,
    SEMANTIC_MODEL_ID,
    TOKEN,
    WORKERS_AI_MODEL,
    address,
)
from harness.cluster.vllm import vllm_url
from harness.gateway import serve_command
from harness.vllm_process import REPO_ROOT, TINY_MODEL_NAME


def gateway_url(host: str) -> str:
    return f"http://{address(host)}:{GATEWAY_PORT}"


def gateway_config(
    host: str, run_dir: Path, model: Path, redis_url: str, *, cache_cluster: bool
) -> str:
    """The gateway's TOML config (gw1 and gw2 differ only in address and data_dir).

    ``cache_cluster``: the shared tier is replicated, so a batch submit, a file upload and
    a ledger flush wait for a replica before they are acknowledged."""
    q = json.dumps
    return "\n".join(
        [
            f"data_dir = {q(str(run_dir / host))}",
            f"policy = {q(str(run_dir / 'policy.toml'))}",
            "[server]",
            f"host = {q(address(host))}",
            f"port = {GATEWAY_PORT}",
            "[[auth.tokens]]",
            f"token = {q(TOKEN)}",
            'tenant = "cluster"',
            'roles = ["admin"]',
            "[[auth.tokens]]",
            f"token = {q(METERED_TOKEN)}",
            'tenant = "metered"',
            f"limits = {{ requests_per_minute = {METERED_RPM} }}",
            "[batch.queue]",
            'kind = "redis"',
            f"redis_url = {q(redis_url)}",
            "lease_s = 10.0",
            *(("replicas = 1", "[ledger]", "replicas = 1") if cache_cluster else ()),
            "[[models]]",
            f"id = {q(MODEL_ID)}",
            'backend = "tiny"',
            f"aliases = [{q(WORKERS_AI_MODEL)}]",
            "[[models]]",
            f"id = {q(SEMANTIC_MODEL_ID)}",
            'backend = "tiny"',
            "[[backends]]",
            'kind = "vllm"',
            'name = "tiny"',
            f"served_model = {q(TINY_MODEL_NAME)}",
            f"model_path = {q(str(model))}",
            "prefill_threshold_tokens = 32",
            "health_interval_s = 1.0",
            "read_timeout_s = 120.0",
            'cache_salt_secret = "cluster-salt"',
            "[[backends.servers]]",
            f"url = {q(vllm_url('p1'))}",
            'role = "prefill"',
            "[[backends.servers]]",
            f"url = {q(vllm_url('d1'))}",
            'role = "decode"',
            "",
        ]
    )


def policy(redis_url: str) -> str:
    """The shared cache policy: the embedded defaults, the shared tier as L3, and the
    semantic cache for ``SEMANTIC_MODEL_ID``."""
    return "\n".join(
        [
            "version = 1",
            "[tiers.redis]",
            f"url = {json.dumps(redis_url)}",
            f"[models.{json.dumps(SEMANTIC_MODEL_ID)}.routes.chat.semantic]",
            "enabled = true",
            "threshold = 0.9",
            "",
        ]
    )


def gateway_service(host: str, run_dir: Path, core: str | None) -> Service:
    """``semcache serve --no-launch`` on ``host`` with its config (on ``core`` if given)."""
    command = serve_command(run_dir / f"{host}.toml", cores=core)
    env = {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return Service(host, command, env, f"{gateway_url(host)}/ready", GATEWAY_PORT)
