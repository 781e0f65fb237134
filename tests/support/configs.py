"""Gateway configs and cache policies written where ``semcache serve`` reads them, and the
policy TOML more than one test module sends."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path

import tomli_w

from harness.ports import free_port
from server.config import DEFAULT_CONFIG, GatewayConfig, parse_config


def write_policy(folder: Path, text: str) -> Path:
    """``folder/policy.toml`` holding ``text`` (the folder made if missing); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "policy.toml"
    path.write_text(text)
    return path


def write_config(
    folder: Path,
    body: str | Mapping[str, object],
    *,
    data_dir: Path | None = None,
    policy: Path | None = None,
) -> Path:
    """``folder/gateway.toml`` (the folder made if missing); its path.

    ``body``: the TOML text, or a mapping written as TOML. ``data_dir`` and ``policy``, when
    given, are put first as the config's ``data_dir`` and ``policy`` keys."""
    folder.mkdir(parents=True, exist_ok=True)
    head: dict[str, str] = {}
    if data_dir is not None:
        head["data_dir"] = str(data_dir)
    if policy is not None:
        head["policy"] = str(policy)
    if isinstance(body, str):
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in head.items()) + body
    else:
        text = tomli_w.dumps({**head, **body})
    path = folder / "gateway.toml"
    path.write_text(text)
    return path


CLASSIFICATION_SEMANTIC = """
[routes.classification]
shared = false
ttl_s = 600
[routes.classification.semantic]
enabled = true
threshold = 0.9
min_threshold = 0.85
"""
"""Classification answers cached per tenant, and reused for close texts."""


def verified_rule(model: str) -> str:
    """``model``'s chat answers reused by the verified semantic cache, its judge the embedding
    similarity, with a prior light enough that a few observations move it."""
    return f"""
[models."{model}".routes.chat.semantic]
mode = "verified"
threshold = 0.6
min_threshold = 0.6
min_observations = 3
prior_weight = 50
audit_rate = 0.0
judge = "embedding"
judge_min_similarity = 0.0
"""


def write_default_config(folder: Path, data_dir: Path) -> tuple[Path, GatewayConfig]:
    """``folder/gateway.toml``: the embedded default (``semcache serve`` with no ``--config``)
    runnable beside other tests: free ports for the launched vLLM servers, their NIXL side
    channels and KV event sockets, and ``data_dir`` (the model's conversion cached across
    runs)."""
    text = DEFAULT_CONFIG.read_text()
    text = text.replace('data_dir = ".data"', f'data_dir = "{data_dir}"')
    for fixed in ("http://127.0.0.1:8100", "http://127.0.0.1:8101"):
        text = text.replace(fixed, f"http://127.0.0.1:{free_port()}")
    for side_channel in ("5600", "5601"):
        text = text.replace(
            f"nixl_side_channel_port = {side_channel}", f"nixl_side_channel_port = {free_port()}"
        )
    for events in ("5610", "5611", "5612", "5613"):  # KV events and replay sockets
        text = text.replace(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{free_port()}")
    config = parse_config(tomllib.loads(text))  # still valid
    path = folder / "gateway.toml"
    path.write_text(text)
    return path, config
