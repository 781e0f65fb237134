"""A config built as objects, written as TOML, loads back as the same config."""

from __future__ import annotations

from pathlib import Path

from harness.gateway import write_config_toml
from server.config import load_config
from tests.conftest import gateway_config


def test_a_written_config_loads_back_equal(tmp_path: Path) -> None:
    config = gateway_config(
        tmp_path / "data", "http://127.0.0.1:9", tmp_path / "model", policy="/p.toml"
    )
    loaded = load_config(write_config_toml(config, tmp_path / "gateway.toml"))
    assert loaded == config
    assert loaded.backends[0].servers[0].url == "http://127.0.0.1:9"
