"""What the chaos tests share: gateway configs on disk, requests, and reading metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME

ADMIN = "admin-secret"


def every_tier_policy(redis_url: str | None = None) -> str:
    """Every tier on: memory, disk (under the data dir), Redis when given; embeddings shared
    and semantic (the default policy's rule)."""
    redis = f"url = {json.dumps(redis_url)}" if redis_url else ""
    return f"""
version = 1
[tiers.memory]
max_bytes = 16_000_000
[tiers.disk]
dir = "cache"
[tiers.redis]
{redis}
timeout_s = 2.0  # a loaded test machine; the outage test stops Redis outright
retry_after_s = 0.2
max_retry_after_s = 1.0
[defaults]
ttl_s = 600
[routes.embeddings]
shared = true
reveal = ["status", "age", "saved", "semantic"]
[routes.embeddings.semantic]
enabled = true
threshold = 0.99
"""


def write_gateway_toml(path: Path, data_dir: Path, models_dir: Path, vllm_url: str) -> Path:
    """A `semcache serve --no-launch` config: the tiny chat model behind ``vllm_url``."""
    lines = [
        f"data_dir = {json.dumps(str(data_dir))}",
        "[server]",
        "drain_timeout_s = 60",
        "[[models]]",
        'id = "tiny-chat"',
        'backend = "tiny"',
        "[[backends]]",
        'kind = "vllm"',
        'name = "tiny"',
        f"served_model = {json.dumps(TINY_MODEL_NAME)}",
        f"model_path = {json.dumps(str(models_dir / TINY_MODEL_NAME))}",
        "[[backends.servers]]",
        f"url = {json.dumps(vllm_url)}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def chat(text: str, **extra: Any) -> dict[str, Any]:
    """A greedy (cacheable) chat request."""
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return parse_metric(text, name, labels)
