"""``GatewayProcess``, the one way tests and benches start ``semcache serve``: its command,
its pinning to cores, its output, and a start that fails saying why."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.gateway import READY, GatewayProcess, serve_command
from tests.support.affinity import thread_affinities

CONFIG = """\
data_dir = "{data}"
[[models]]
id = "chat"
backend = "nowhere"
[[backends]]
kind = "vllm"
name = "nowhere"
served_model = "none"
[[backends.servers]]
url = "http://127.0.0.1:9"
"""


def test_the_command_runs_serve_of_the_config_pinned_with_taskset(tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    serve = [sys.executable, "-m", "server.cli", "serve"]
    assert serve_command(config) == [*serve, "--no-launch", "--config", str(config)]
    assert serve_command(config, port=9, launch=True, cores={2, 0}, args=["--policy", "p"]) == [
        *("taskset", "-c", "0,2"),
        *serve,
        *("--config", str(config), "--port", "9", "--policy", "p"),
    ]
    assert serve_command(config, cores="1-2")[:3] == ["taskset", "-c", "1-2"]


@pytest.mark.slow
def test_a_pinned_gateway_runs_every_thread_on_its_core(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    config = tmp_path / "gw.toml"
    config.write_text(CONFIG.format(data=tmp_path / "data"))
    log = tmp_path / "gateway.log"
    gw = GatewayProcess(config, cores={core}, log=log).start(120)
    try:
        assert gw.wait_answers("/health", 30) > 0
        threads = thread_affinities(gw.pid)
        assert threads and set(threads.values()) == {frozenset({core})}, threads
        assert any(READY in line for line in gw.lines)
    finally:
        gw.stop()
    assert gw.proc is not None and gw.proc.returncode is not None
    assert READY in log.read_text()  # the same output, kept in the log


@pytest.mark.slow
def test_a_gateway_that_cannot_start_fails_at_once_with_its_output(tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    config.write_text('[[models]]\nid = "chat"\nbackend = "missing"\n')
    with pytest.raises(AssertionError, match="missing") as failed:
        GatewayProcess(config).start(120)
    assert "exited with" in str(failed.value)
