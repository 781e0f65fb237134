"""The embedded default config (``semcache serve`` with no ``--config``), made runnable beside
other tests: free ports for the launched vLLM servers, their NIXL side channels and KV event
sockets, and the test data dir (the model's conversion cached across runs)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from harness.ports import free_port
from server.config import DEFAULT_CONFIG, GatewayConfig, parse_config


def write_default_config(folder: Path, data_dir: Path) -> tuple[Path, GatewayConfig]:
    """``folder/gateway.toml``: the shipped default with free ports and ``data_dir``."""
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
