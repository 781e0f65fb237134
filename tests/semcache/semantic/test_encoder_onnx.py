"""The encoder on ONNX Runtime: picked on a CPU, the graph exported once per model
version, the same vectors as the torch encoder (the module itself: tests/backends)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.local.onnx_model import GRAPH_FILE, OnnxSentenceModel
from semcache.semantic.encoder import Encoder
from server.encoders import load_encoder

TEXTS = [
    "How do I lose 10 kg in a month?",
    "What is the capital of France?",
    "x",
    "A much longer question about the history of the Roman empire and its fall " * 30,
    "Ünïcödé and emoji 🙂",
] + [f"Question number {i}: how do I cook {i} eggs?" for i in range(150)]


@pytest.fixture(scope="module")
def torch_encoder() -> Encoder:
    return load_encoder(runtime="torch", threads=1)


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


@pytest.fixture(scope="module")
def onnx_encoder(graph_dir: Path) -> Encoder:
    return load_encoder(runtime="onnx", threads=1, graph_dir=graph_dir)


def test_auto_picks_onnx_on_a_cpu_and_exports_once(onnx_encoder: Encoder, graph_dir: Path) -> None:
    assert onnx_encoder.runtime == "onnx"
    assert isinstance(onnx_encoder.model, OnnxSentenceModel)
    graphs = list(graph_dir.rglob(GRAPH_FILE))
    assert len(graphs) == 1
    # The folder is the model's version, so a retrained model gets its own graph.
    assert onnx_encoder.version == f"st-{graphs[0].parent.name}"
    stamp = graphs[0].stat().st_mtime_ns
    again = load_encoder(threads=1, graph_dir=graph_dir)
    assert again.runtime == "onnx"
    assert graphs[0].stat().st_mtime_ns == stamp  # loaded, not exported again


def test_vectors_match_torch(onnx_encoder: Encoder, torch_encoder: Encoder) -> None:
    # 155 texts: more than one model batch, so sorting by length and restoring order is used.
    onnx = onnx_encoder.encode_sync(TEXTS)
    torch = torch_encoder.encode_sync(TEXTS)
    assert onnx.shape == torch.shape == (len(TEXTS), torch_encoder.dimensions)
    assert float(np.abs(onnx - torch).max()) < 1e-5
    one = onnx_encoder.encode_sync([TEXTS[3]])  # truncated to the model's 256 tokens
    assert float(np.abs(one - torch[3]).max()) < 1e-5
    assert onnx_encoder.version == torch_encoder.version
    assert onnx_encoder.count_tokens(TEXTS[:4]) == torch_encoder.count_tokens(TEXTS[:4])


async def test_async_batches_match_torch(onnx_encoder: Encoder, torch_encoder: Encoder) -> None:
    vectors = await onnx_encoder.encode(TEXTS[:8])
    np.testing.assert_allclose(vectors, torch_encoder.encode_sync(TEXTS[:8]), atol=1e-5)
    await onnx_encoder.aclose()


def test_unknown_runtime_is_refused() -> None:
    with pytest.raises(ValueError, match="runtime"):
        load_encoder(runtime="tensorrt")
