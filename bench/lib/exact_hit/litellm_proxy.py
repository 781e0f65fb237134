"""Target (c): LiteLLM's proxy, installed in a bench-only virtualenv, and its config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from bench.lib.exact_hit.workload import MASTER_KEY
from bench.lib.support import GATEWAY_MODEL_ID, REPO, stderr_printer

LITELLM_SPEC = "litellm[proxy]==1.106.12"
"""Pinned. Later releases moved the proxy into a ``litellm-proxy`` package the index lacks."""
LITELLM_VENV = REPO / ".data" / "bench-venv-litellm"

say = stderr_printer("exact_hit")


def litellm_installed(venv: Path) -> bool:
    marker = venv / ".bench-installed"
    return (
        (venv / "bin" / "litellm").is_file()
        and marker.is_file()
        and (marker.read_text().strip() == LITELLM_SPEC)
    )


def setup_litellm(venv: Path) -> str | None:
    """Install LiteLLM's proxy into ``venv`` (a virtualenv of its own); None, or why not."""
    if litellm_installed(venv):
        return None
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    python = venv / "bin" / "python"
    say(f"installing {LITELLM_SPEC} into {venv} (once; several minutes)…")
    steps = [
        [str(base), "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", LITELLM_SPEC],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
        except OSError as exc:
            return f"`{' '.join(step)}` could not run: {exc}"
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if "ignored" not in ln]
            tail = "\n".join(lines[-6:])
            return f"`{' '.join(step)}` failed (exit {done.returncode}):\n{tail}"
    (venv / ".bench-installed").write_text(LITELLM_SPEC + "\n")
    return None


def litellm_config(vllm_url: str, served: str) -> bytes:
    """LiteLLM's proxy config (JSON is valid YAML): the tiny vLLM as an OpenAI backend."""
    return orjson.dumps(
        {
            "model_list": [
                {
                    "model_name": GATEWAY_MODEL_ID,
                    "litellm_params": {
                        "model": f"openai/{served}",
                        "api_base": f"{vllm_url}/v1",
                        "api_key": "none",
                    },
                }
            ],
            # its in-memory entries live 600 s unless told otherwise
            "litellm_settings": {"cache": True, "cache_params": {"type": "local", "ttl": 86400}},
            "general_settings": {"master_key": MASTER_KEY},
        },
        option=orjson.OPT_INDENT_2,
    )
