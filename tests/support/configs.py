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
from server.identity.admin_token import AdminSettings
from server.identity.auth import AuthSettings


def admin_auth(token: str) -> AuthSettings:
    """``[auth]`` with the admin token ``token`` (``[auth.admin]``) and no API token."""
    return AuthSettings(admin=AdminSettings(token=token))


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


def write_default_config(
    tmp_path: Path, data_dir: Path, extra: str = "", name: str = "gateway.toml"
) -> tuple[Path, GatewayConfig]:
    """The shipped default config with free ports, ``data_dir`` and ``extra`` (TOML appended
    to it), written under ``tmp_path``; the file and the config it parses to."""
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
    text += extra
    config = parse_config(tomllib.loads(text))  # still valid
    path = tmp_path / name
    path.write_text(text)
    return path, config


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
