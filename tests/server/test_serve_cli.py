"""`semcache serve` end to end: the embedded default (real SmolLM2 on vLLM), then Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from harness.ports import free_port
from server.config import DEFAULT_CONFIG, parse_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def _write_config(tmp_path: Path, data_dir: Path, vllm_port: int) -> Path:
    """The shipped default config with free ports and the test data dir (conversion cached)."""
    text = DEFAULT_CONFIG.read_text()
    text = text.replace('data_dir = ".data"', f'data_dir = "{data_dir}"')
    text = text.replace("http://127.0.0.1:8100", f"http://127.0.0.1:{vllm_port}")
    parse_config(tomllib.loads(text))  # still valid
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_serve_default_answers_openai_sdk_and_stops_cleanly(tmp_path: Path, data_dir: Path) -> None:
    vllm_port, port = free_port(), free_port()
    config = _write_config(tmp_path, data_dir, vllm_port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "[semcache] ready" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(600), "".join(lines[-40:])
        out = "".join(lines)
        assert "starting vLLM" in out
        assert "waiting for vLLM" in out or "vLLM ready" in out

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, temperature=0, max_tokens=30
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        stream = client.chat.completions.create(
            model="@cf/huggingface/smollm2-135m-instruct",
            messages=question,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer.choices[0].message.content
        assert chunks[-1].usage is not None
        emb = client.embeddings.create(model="all-MiniLM-L6-v2", input=["Paris", "France"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert family, "vLLM runs as a child of semcache serve"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, "".join(lines[-30:])

    # vLLM's multiprocessing resource trackers exit with their server but end as zombies of
    # init, which reaps them a moment later: dead, not left behind. Nothing may still run.
    def ctrl_c_left_nothing_behind() -> bool:
        return not [pid for pid in family if _running(pid)]

    wait_until(ctrl_c_left_nothing_behind, timeout_s=10)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{vllm_port}/health")
