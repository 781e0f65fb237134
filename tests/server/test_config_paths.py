"""Where the gateway keeps what it derives: the encoders' exported graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.local.embedding import LocalEmbeddingBackend
from server.app import registry_from_config
from server.config import ENCODER_DIR_ENV, GatewayConfig
from tests.conftest import gateway_config


def test_the_encoder_dir_is_the_configs_else_the_environments_else_the_data_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENCODER_DIR_ENV, raising=False)
    assert GatewayConfig(data_dir=str(tmp_path)).encoder_path() == tmp_path / "encoders"
    monkeypatch.setenv(ENCODER_DIR_ENV, str(tmp_path / "shared"))
    assert GatewayConfig(data_dir=str(tmp_path)).encoder_path() == tmp_path / "shared"
    chosen = GatewayConfig(data_dir=str(tmp_path), encoder_dir=str(tmp_path / "mine"))
    assert chosen.encoder_path() == tmp_path / "mine"


def test_the_embeddings_backend_exports_into_the_encoder_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENCODER_DIR_ENV, raising=False)
    config = gateway_config(tmp_path / "data", "http://127.0.0.1:9")
    config.encoder_dir = str(tmp_path / "graphs")
    backend = registry_from_config(config).embedding["minilm"]
    assert isinstance(backend, LocalEmbeddingBackend)
    assert backend.graph_dir == tmp_path / "graphs"
