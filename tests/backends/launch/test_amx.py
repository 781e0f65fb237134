"""The launch shim that keeps vLLM's AMX kernels out of a launched CPU server, or asks Linux
for the tile registers when they are wanted.

These fail loudly when vLLM or torch change what the shim relies on (see
backends/launch/amx.py). The servers it protects are proven by the real-vLLM tests: the
default ``semcache serve`` pair knows Paris (tests/server/test_serve_cli.py), and the P/D tests
decode prompts pulled over NIXL without the engine dying.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.config import VllmLaunch, VllmServer
from backends.launch import amx
from backends.launch.command import build_command

MODEL = Path("/models/m")
PROBE = """
import torch
from backends.launch import amx
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
print(torch.cpu._is_amx_tile_supported(), _get_attn_isa(torch.bfloat16, 32), amx.permitted())
"""


def cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def probe(env: dict[str, str]) -> list[str]:
    """What a launched server's interpreter sees, started with ``env`` (the shim's path too)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1].split()


def launch_env(**launch: bool) -> dict[str, str]:
    server = VllmServer(url="http://127.0.0.1:8000", launch=VllmLaunch(**launch))
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    return env


def test_the_installed_torch_is_a_checked_version() -> None:
    version = importlib.metadata.version("torch")
    assert ".".join(version.split(".")[:2]) in amx.CHECKED_VERSIONS, (
        f"torch {version}: re-check backends/launch/amx.py against torch.cpu"
    )


def test_vllm_still_picks_its_attention_kernels_from_torchs_amx_check() -> None:
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    source = inspect.getsource(cpu_attn._get_attn_isa)
    assert "torch.cpu._is_amx_tile_supported()" in source
    assert 'return "amx"' in source


def test_cpu_servers_get_the_setting_and_gpu_servers_none() -> None:
    assert launch_env()[amx.ENV] == "off"
    assert launch_env(amx=True)[amx.ENV] == "on"
    shim = Path(launch_env()["PYTHONPATH"].split(os.pathsep)[0])
    assert (shim / "sitecustomize.py").is_file()
    server = VllmServer(url="http://127.0.0.1:8000", launch=VllmLaunch())
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cuda", python="p")
    assert amx.ENV not in env


@pytest.mark.slow
def test_off_vllm_takes_the_avx512_kernels_and_on_the_tiles_are_granted() -> None:
    assert probe(launch_env())[:2] == ["False", "vec"]
    granted = probe(launch_env(amx=True))
    if not cpu_has_amx():
        assert granted == ["False", "vec", "False"]
        return
    assert granted == ["True", "amx", "True"]  # without the request: False (a SIGILL later)
