"""A sentence-transformers model's forward pass through ONNX Runtime.

Used by the semantic cache's encoder and by the local embeddings backend. On a CPU the
same all-MiniLM-L6-v2 graph runs faster in ONNX Runtime than in torch (fewer, fused kernels
and no Python per layer; figures in ``bench/RESULTS.md``). The graph is exported once from
the model folder with torch's exporter, cached as ``<graph dir>/<model version>/model.onnx``
(``backends.models.model_version``), and checked on probe sentences each time it is loaded:
against the torch model, whose probe vectors are then kept beside the graph, or, once they
are kept, against those, so that later loads need neither torch nor sentence-transformers
(:func:`load_checked_graph`, seconds less at start-up). A graph that disagrees with torch is
exported again, and a model it cannot reproduce stays on torch. The vectors are the torch
model's to float rounding (``MAX_ABS_DIFF`` is checked at every load), so the encoder
version, thresholds and the verifier are unchanged, and so are the embeddings the gateway
serves.

Only models made of a Transformer, mean pooling and (optionally) Normalize are exported;
anything else stays on torch.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from foundation.files import write_atomic

log = logging.getLogger(__name__)

GRAPH_FILE = "model.onnx"
REFERENCE_FILE = "probes.npy"
"""Torch's vectors of :data:`PROBES`, kept beside a graph that reproduced them: a later load
checks the graph against these without loading torch (:func:`load_checked_graph`)."""
MAX_ABS_DIFF = 1e-4
"""The most a probe vector may differ from torch's, per component, for the graph to be used."""
PROBES = (
    "How do I lose 10 kg in a month?",
    "a",
    "What is the capital of France? " * 40,  # past the truncation length
    "Ünïcödé, emoji 🙂 and numbers 3.14159",
)
CHUNK_TEXTS = 8
"""Texts per forward pass. One pass over many short texts pads them all to the longest, which
costs more per text than encoding them one at a time; length-sorted passes of a few texts
cost less than either."""
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
RUNTIMES = ("auto", "onnx", "torch")
RUNTIME_ENV = "SEMCACHE_ENCODER_RUNTIME"
"""Sets the default runtime of the semantic encoder and of the local embeddings backends."""


class OnnxUnsupported(RuntimeError):
    """The model cannot run through ONNX Runtime here (shape, runtime or a failed check)."""


class OnnxSentenceModel:
    """Mean-pooled, optionally normalised sentence vectors from an ONNX transformer graph.

    Offers the part of ``SentenceTransformer`` the encoder and the embeddings backend use:
    ``encode`` (``normalize_embeddings`` included) and ``tokenizer``.
    """

    def __init__(
        self,
        session: Any,
        tokenizer: Any,
        *,
        max_seq_length: int,
        normalize: bool,
        batch_size: int = 64,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.normalize = normalize
        self.batch_size = batch_size
        self._inputs = [i.name for i in session.get_inputs()]
        self.dimensions = int(session.get_outputs()[0].shape[-1])

    def encode(
        self,
        sentences: list[str],
        *,
        batch_size: int | None = None,
        show_progress_bar: bool = False,
        normalize_embeddings: bool = False,
        **_: Any,
    ) -> np.ndarray:
        """Vectors for ``sentences`` in order.

        As ``SentenceTransformer.encode``: the model's own Normalize module (if any) always
        applies, and ``normalize_embeddings`` normalises on top of it. Several texts run
        sorted by length in chunks of at most :data:`CHUNK_TEXTS` (or ``batch_size`` if
        smaller), so little of a chunk is padding.
        """
        vectors = self._encode(sentences, batch_size, show_progress_bar)
        if normalize_embeddings:
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors

    def _encode(
        self, sentences: list[str], batch_size: int | None, show_progress_bar: bool
    ) -> np.ndarray:
        if len(sentences) <= 1:
            return self._batch(sentences)
        size = min(batch_size or self.batch_size, CHUNK_TEXTS)
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        starts = range(0, len(sentences), size)
        if show_progress_bar:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="encode", unit="chunk", disable=None)
        parts = [self._batch([sentences[i] for i in order[s : s + size]]) for s in starts]
        out = np.empty((len(sentences), parts[0].shape[1]), dtype=np.float32)
        out[np.asarray(order)] = np.concatenate(parts)
        return out

    def _batch(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        features = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="np",
        )
        feed = {name: np.asarray(features[name], dtype=np.int64) for name in self._inputs}
        hidden = self.session.run(None, feed)[0]
        mask = feed["attention_mask"][..., None].astype(np.float32)
        vectors = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        if self.normalize:
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def physical_cores() -> int:
    """The physical cores this process may run on (torch's default intra-op thread count),
    read without torch: ``OMP_NUM_THREADS`` if set, else the distinct (package, core) pairs
    of the allowed CPUs in sysfs, else their count."""
    if (omp := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(omp) > 0:
        return int(omp)
    allowed = os.sched_getaffinity(0)
    cores = set()
    try:
        for cpu in allowed:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
    except OSError:
        return max(1, len(allowed))
    return max(1, len(cores))


def requested_runtime(runtime: str | None) -> str:
    """``runtime``, else :data:`RUNTIME_ENV`, else ``auto``; ValueError if not in RUNTIMES."""
    chosen = runtime or os.environ.get(RUNTIME_ENV) or "auto"
    if chosen not in RUNTIMES:
        raise ValueError(f"encoder runtime must be one of {RUNTIMES}, not {chosen!r}")
    return chosen


def onnx_or_torch(
    model: Any, graph_dir: Path, *, required: bool, threads: int, batch_size: int = 64
) -> tuple[Any, str | None]:
    """(the model to run, why ONNX was not used): the ONNX twin of ``model`` when it loads and
    passes the check, else ``model`` itself with the reason; with ``required`` the failure
    raises :class:`OnnxUnsupported` instead."""
    try:
        return load_onnx_model(model, graph_dir, threads=threads, batch_size=batch_size), None
    except OnnxUnsupported as exc:
        if required:
            raise
        return model, str(exc)


def load_onnx_model(
    model: Any, graph_dir: Path, *, threads: int, batch_size: int = 64
) -> OnnxSentenceModel:
    """The ONNX twin of a loaded ``SentenceTransformer``, exporting it once into ``graph_dir``.

    Raises :class:`OnnxUnsupported` when the model's shape is not a Transformer with mean
    pooling, ONNX Runtime is missing, or the graph cannot reproduce the torch vectors.
    """
    normalize = _check_shape(model)
    try:
        import onnxruntime
    except ImportError as exc:
        raise OnnxUnsupported("onnxruntime is not installed") from exc
    path = graph_dir / GRAPH_FILE
    expected = model.encode(
        list(PROBES), convert_to_numpy=True, normalize_embeddings=normalize, show_progress_bar=False
    )
    why = ""
    for attempt in range(2):
        if attempt or not path.is_file():
            export_graph(model, path)
        try:
            twin = OnnxSentenceModel(
                _session(onnxruntime, path, threads),
                model.tokenizer,
                max_seq_length=int(model.max_seq_length),
                normalize=normalize,
                batch_size=batch_size,
            )
            diff = _probe_diff(twin, expected)
        except Exception as exc:  # a truncated or foreign file: ONNX Runtime's own errors
            why = f"the graph does not load: {exc}"
        else:
            if diff <= MAX_ABS_DIFF:
                _write_reference(graph_dir / REFERENCE_FILE, expected)
                return twin
            why = f"the graph differs from torch by {diff:.2g}"
        log.warning("ONNX encoder %s: %s; exporting it again", path, why)
    raise OnnxUnsupported(why)


def load_checked_graph(
    model_dir: Path, graph_dir: Path, *, threads: int, batch_size: int = 64
) -> OnnxSentenceModel | None:
    """The ONNX twin of the model in ``model_dir`` from a graph that an earlier load checked
    against torch, without importing torch or sentence-transformers; None (load the model
    and check it against torch) unless the graph, torch's probe vectors, a ``tokenizer.json``
    and a Transformer → mean Pooling [→ Normalize] layout are all there and the graph still
    reproduces those vectors."""
    layout = _layout(model_dir)
    if layout is None or not (graph_dir / GRAPH_FILE).is_file():
        return None
    max_seq_length, normalize = layout
    try:
        import onnxruntime

        from backends.local.onnx_tokenizer import TOKENIZER_FILE, JsonTokenizer

        if not (model_dir / TOKENIZER_FILE).is_file():
            return None
        expected = np.load(graph_dir / REFERENCE_FILE)
        twin = OnnxSentenceModel(
            _session(onnxruntime, graph_dir / GRAPH_FILE, threads),
            JsonTokenizer(model_dir, max_seq_length),
            max_seq_length=max_seq_length,
            normalize=normalize,
            batch_size=batch_size,
        )
        diff = _probe_diff(twin, expected)
    except Exception as exc:  # no reference yet, a foreign file, a missing runtime
        log.info("ONNX encoder %s is checked against torch: %s", graph_dir, exc)
        return None
    if diff > MAX_ABS_DIFF:
        log.warning("ONNX encoder %s differs from its reference by %.2g", graph_dir, diff)
        return None
    return twin


def _layout(model_dir: Path) -> tuple[int, bool] | None:
    """(max_seq_length, normalizes) of a sentence-transformers folder made of a Transformer,
    mean pooling and optionally Normalize, read from its JSON files; None for anything else."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        types = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
        if types not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return None
        pooling = json.loads((model_dir / modules[1]["path"] / "config.json").read_text())
        modes = {k: v for k, v in pooling.items() if k.startswith("pooling_mode")}
        if modes.get("pooling_mode_mean_tokens") is not True or sum(map(bool, modes.values())) != 1:
            return None
        settings = json.loads((model_dir / "sentence_bert_config.json").read_text())
        if settings.get("do_lower_case") or not settings.get("max_seq_length"):
            return None
        return int(settings["max_seq_length"]), types[-1] == "Normalize"
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _write_reference(path: Path, vectors: np.ndarray) -> None:
    out = io.BytesIO()
    np.save(out, np.asarray(vectors, dtype=np.float32))
    write_atomic(path, out.getvalue())


def _probe_diff(twin: OnnxSentenceModel, expected: np.ndarray) -> float:
    """The largest per-component gap between the twin's probe vectors and ``expected``."""
    return float(np.abs(twin.encode(list(PROBES)) - expected).max())


def export_graph(model: Any, path: Path) -> None:
    """Export the model's transformer (token states out) to ``path``, atomically."""
    import torch

    transformer = model[0].auto_model
    # A copy: tracing may change the module it runs (seen: the live model's vectors drift).
    clone = copy.deepcopy(transformer).eval()
    names = [name for name in _INPUTS if name in _forward_inputs(model)]

    class TokenStates(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return self.inner(**dict(zip(names, tensors, strict=True))).last_hidden_state

    example = model.tokenizer(
        ["hello world", "a longer example sentence"], padding=True, return_tensors="pt"
    )
    axes = {name: {0: "batch", 1: "tokens"} for name in [*names, "token_states"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent branches
            torch.onnx.export(
                TokenStates(clone),
                tuple(example[name] for name in names),
                str(tmp),
                input_names=names,
                output_names=["token_states"],
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _forward_inputs(model: Any) -> list[str]:
    features = model.tokenizer(["x"], return_tensors="np")
    return [name for name in _INPUTS if name in features]


def _check_shape(model: Any) -> bool:
    """Whether the model normalises; raises unless it is Transformer, mean Pooling [, Normalize]."""
    from sentence_transformers.models import Normalize, Pooling, Transformer

    modules = list(model)
    if len(modules) not in (2, 3) or not isinstance(modules[0], Transformer):
        raise OnnxUnsupported("not a Transformer followed by pooling")
    pooling = modules[1]
    if not isinstance(pooling, Pooling) or _pooling_mode(pooling) != "mean":
        raise OnnxUnsupported("pooling is not a plain mean")
    if len(modules) == 3 and not isinstance(modules[2], Normalize):
        raise OnnxUnsupported("the third module is not Normalize")
    return len(modules) == 3


def _pooling_mode(pooling: Any) -> str:
    mode = getattr(pooling, "pooling_mode", None)  # sentence-transformers 6
    if mode is None:
        mode = pooling.get_pooling_mode_str()
    if isinstance(mode, list | tuple):
        mode = "+".join(str(m) for m in mode)
    return str(mode)


def _session(onnxruntime: Any, path: Path, threads: int) -> Any:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle pool threads must sleep, not spin: the gateway and vLLM share these cores.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
