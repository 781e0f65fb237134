"""The sampling defaults vLLM applies, read as its ``--generation-config`` setting says."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from backends.generation_defaults import launch_defaults


def folder(path: Path, name: str, files: dict[str, object]) -> Path:
    out = path / name
    out.mkdir()
    for file, data in files.items():
        (out / file).write_bytes(orjson.dumps(data))
    return out


def test_auto_reads_the_checkpoint_and_renames_max_new_tokens(tmp_path: Path) -> None:
    gen = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 64, "bos_token_id": 1}
    ckpt = folder(tmp_path, "c", {"generation_config.json": gen, "config.json": {}})
    assert launch_defaults(ckpt) == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    assert launch_defaults(ckpt, ["--generation-config=auto"]) == launch_defaults(ckpt)


def test_vllm_ignores_the_file_but_not_the_overrides(tmp_path: Path) -> None:
    ckpt = folder(tmp_path, "c", {"generation_config.json": {"temperature": 0.6}})
    assert launch_defaults(ckpt, ["--generation-config", "vllm"]) == {}
    args = ["--generation_config", "vllm", "--override-generation-config", '{"top_p": 0.5}']
    assert launch_defaults(ckpt, args) == {"top_p": 0.5}


def test_a_folder_setting_reads_that_folder(tmp_path: Path) -> None:
    ckpt = folder(tmp_path, "c", {"generation_config.json": {"temperature": 0.6}})
    other = folder(tmp_path, "o", {"generation_config.json": {"temperature": 0.3}})
    assert launch_defaults(ckpt, ["--generation-config", str(other)]) == {"temperature": 0.3}


def test_without_a_generation_config_the_model_config_counts(tmp_path: Path) -> None:
    ckpt = folder(tmp_path, "c", {"config.json": {"text_config": {"temperature": 0.7}}})
    assert launch_defaults(ckpt) == {"temperature": 0.7}
    assert launch_defaults(None) == {}


def test_a_bad_override_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON object"):
        launch_defaults(None, ["--override-generation-config", "[1]"])
