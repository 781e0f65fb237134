"""``semcache backends run``: a container's vLLM role, through the real processes.

The command starts one vLLM server of the tiny pool with the pool's launch settings, joins a
real ``semcache serve`` gateway's pool once healthy, serves its requests, and on SIGTERM
drains out of the gateway before it stops vLLM and exits 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import REPO_ROOT, SINGLE_PROCESS_ARGS, SINGLE_PROCESS_ENV
from harness.vllm_process import TINY_MODEL_NAME as TINY
from tests.support.configs import write_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer tok-ops"}


def run_config(tmp: Path, model: Path, shared_url: str, template_url: str) -> Path:
    """The session's tiny server, and a pool template no process listens at: the launch
    settings ``backends run`` takes (one process, a small KV cache)."""
    launch = {
        "kv_cache_gib": 0.25,
        "max_model_len": 1024,
        "extra_args": list(SINGLE_PROCESS_ARGS),
        "env": SINGLE_PROCESS_ENV,
    }
    backend = {
        "kind": "vllm",
        "name": "tiny",
        "served_model": TINY,
        "model_path": str(model),
        "health_interval_s": 1.0,
        "servers": [{"url": shared_url}, {"url": template_url, "launch": launch}],
    }
    config = {
        "cache": False,
        "keys": {"enabled": False},
        "auth": {"tokens": [{"tenant": "ops", "token": "tok-ops", "roles": ["admin"]}]},
        "models": [{"id": "tiny-chat", "backend": "tiny"}],
        "backends": [backend],
    }
    return write_config(tmp, config, data_dir=tmp / "data")


def pool(http: httpx.Client, gateway: GatewayProcess) -> dict[str, str]:
    pools = http.get(f"{gateway.url}/admin/backends", headers=ADMIN).json()["data"]
    return {s["url"]: s["state"] for p in pools for s in p["servers"]}


def test_a_run_server_joins_serves_and_drains_out_on_sigterm(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess
) -> None:
    template = f"http://127.0.0.1:{free_port()}"
    config = run_config(tmp_path, data_dir / "models" / TINY, tiny_vllm.url, template)
    gateway = GatewayProcess(config).start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "run.log").open("wb")
    command = [sys.executable, "-m", "server.cli", "backends", "run", "tiny/both"]
    command += ["--config", str(config), "--port", str(port), "--join", gateway.url]
    command += ["--token", "tok-ops", "--drain-timeout", "30"]
    run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=120) as http:
            wait_until(lambda: pool(http, gateway).get(url) == "serving" or run.poll(), 300, 0.5)
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            served = httpx.get(f"{url}/v1/models").json()["data"]
            assert [m["id"] for m in served] == [TINY]  # vLLM itself, on the port given

            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=60) == 0
            assert url not in pool(http, gateway)  # it drained out before it stopped
            output = (tmp_path / "run.log").read_text()
            assert "left /admin/backends/tiny/both/servers (drained)" in output
            assert "Uvicorn running" in output or "Started server process" in output  # vLLM's
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        log.close()
        gateway.stop()
