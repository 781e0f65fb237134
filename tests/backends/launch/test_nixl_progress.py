"""The launch shim that lets an idle P/D server's NIXL progress thread sleep.

These fail loudly when nixl changes the code the shim relies on (see
backends/launch/nixl_progress.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.config import VllmLaunch, VllmServer
from backends.launch import nixl_progress
from backends.launch.command import build_command

MODEL = Path("/models/m")


def agent_module() -> object:
    importlib.import_module("nixl._api")
    loaded = [sys.modules[m] for m in nixl_progress.AGENT_MODULES if m in sys.modules]
    assert loaded, f"nixl loaded none of {nixl_progress.AGENT_MODULES}"
    return loaded[0]


def test_the_installed_nixl_is_a_checked_version() -> None:
    version = importlib.metadata.version("nixl")
    assert version.rsplit(".", 1)[0] in nixl_progress.CHECKED_VERSIONS, (
        f"nixl {version}: re-check backends/launch/nixl_progress.py against its nixl_agent.__init__"
    )


def test_the_agent_still_builds_its_config_with_a_zero_delay() -> None:
    source = inspect.getsource(agent_module().nixl_agent.__init__)  # type: ignore[attr-defined]
    assert "nixlBind.nixlAgentConfig()" in source
    assert "pthrDelay = 0" in source


def test_a_patched_config_takes_the_delay_and_the_agent_still_starts() -> None:
    module = agent_module()
    real = module.nixlBind  # type: ignore[attr-defined]
    try:
        nixl_progress.patch(module, 2500)  # type: ignore[arg-type]
        config = module.nixlBind.nixlAgentConfig()  # type: ignore[attr-defined]
        config.pthrDelay = 0
        assert config.pthrDelay == 2500
        config.lthrDelay = 7  # every other field as set
        assert config.lthrDelay == 7
        api = importlib.import_module("nixl._api")
        agent = api.nixl_agent("semcache-test", api.nixl_agent_config(backends=["UCX"]))
        assert agent.name == "semcache-test"
    finally:
        module.nixlBind = real  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("role", "delay", "shimmed"),
    [("prefill", 1000, True), ("decode", 50, True), ("both", 1000, False), ("decode", 0, False)],
)
def test_launched_pd_servers_get_the_shim(role: str, delay: int, shimmed: bool) -> None:
    launch = VllmLaunch(nixl_progress_delay_us=delay)
    server = VllmServer(url="http://127.0.0.1:8000", role=role, launch=launch)  # type: ignore[arg-type]
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    if not shimmed:
        assert nixl_progress.DELAY_ENV not in env
        return
    assert env[nixl_progress.DELAY_ENV] == str(delay)
    shim = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (shim / "sitecustomize.py").is_file()


def test_a_process_started_with_the_shim_patches_nixl_when_it_loads() -> None:
    server = VllmServer(url="http://127.0.0.1:8000", role="prefill", launch=VllmLaunch())
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    probe = (
        "import sys, nixl._api;"
        f"m = [sys.modules[n] for n in {nixl_progress.AGENT_MODULES!r} if n in sys.modules][0];"
        "c = m.nixlBind.nixlAgentConfig(); c.pthrDelay = 0; print(c.pthrDelay)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == str(VllmLaunch().nixl_progress_delay_us)
