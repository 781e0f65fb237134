"""Pools changed at run time, through real ``semcache serve`` processes in front of real vLLM:
a gateway restarted, or killed and started again, serves the pools as the admin API left
them, and on a shared Redis every gateway applies a change made on one at once.

Each config names one vLLM server where nothing listens; the tiny vLLM server joins through
the admin API and the dead one is drained, so a chat answer after the restart can only come
from the server that was added at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME
from tests.semcache.conftest import RedisServer
from tests.support.configs import write_config, write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer tok-ops"}
SERVERS = "/admin/backends/tiny/both/servers"
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROPAGATION_S = 2.0
"""A change made on one gateway is applied on the others within this (pub/sub)."""


def pool_config(tmp: Path, models_dir: Path, dead_url: str, redis_url: str | None) -> Path:
    tmp.mkdir()
    policy = write_policy(
        tmp,
        f'[tiers.redis]\nurl = {json.dumps(redis_url)}\nprefix = "{tmp.name}-fleet"\n'
        if redis_url
        else "",
    )
    return write_config(
        tmp,
        "cache = false\n"
        "[keys]\nenabled = false\n"
        '[[auth.tokens]]\ntenant = "ops"\ntoken = "tok-ops"\nroles = ["admin"]\n'
        '[[models]]\nid = "tiny-chat"\nbackend = "tiny"\n'
        '[[backends]]\nkind = "vllm"\nname = "tiny"\n'
        f"served_model = {json.dumps(TINY_MODEL_NAME)}\n"
        f"model_path = {json.dumps(str(models_dir / TINY_MODEL_NAME))}\n"
        "health_interval_s = 1.0\n"
        f"[[backends.servers]]\nurl = {json.dumps(dead_url)}\n",
        data_dir=tmp / "data",
        policy=policy,
    )


def servers(http: httpx.Client, gateway: GatewayProcess) -> list[tuple[str, str]]:
    pools = http.get(f"{gateway.url}/admin/backends", headers=ADMIN).json()["data"]
    return [(s["url"], s["state"]) for p in pools for s in p["servers"]]


def chat(http: httpx.Client, gateway: GatewayProcess) -> dict[str, Any]:
    r = http.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=ADMIN)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def move_to(http: httpx.Client, gateway: GatewayProcess, url: str, dead: str) -> None:
    """The tiny vLLM server joins, the dead one leaves: the whole pool changed at run time."""
    added = http.post(f"{gateway.url}{SERVERS}", json={"url": url}, headers=ADMIN)
    assert added.status_code == 200, added.text
    drained = http.delete(f"{gateway.url}{SERVERS}", params={"url": dead}, headers=ADMIN)
    assert drained.status_code == 200, drained.text
    assert servers(http, gateway) == [(url, "serving")]


def test_a_restarted_gateway_serves_the_pools_it_was_left_with(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = pool_config(tmp_path / "solo", data_dir / "models", dead, None)
    gateway = GatewayProcess(config).start()
    with httpx.Client(timeout=120) as http:
        try:
            move_to(http, gateway, tiny_vllm.url, dead)
            assert chat(http, gateway)["model"] == TINY_MODEL_NAME  # vLLM's own answer
        finally:
            gateway.stop()
        gateway = GatewayProcess(config).start()  # SIGINT'ed, started again on the same files
        try:
            wait_until(lambda: servers(http, gateway) == [(tiny_vllm.url, "serving")], 10)
            assert chat(http, gateway)["model"] == TINY_MODEL_NAME
        finally:
            gateway.stop()


def test_a_change_reaches_every_gateway_on_redis_and_outlives_a_killed_one(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess, redis_server: RedisServer
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    models = data_dir / "models"
    one = GatewayProcess(pool_config(tmp_path / "one", models, dead, redis_server.url))
    two = GatewayProcess(pool_config(tmp_path / "two", models, dead, redis_server.url))
    # the two configs share one Redis prefix: the fleet's
    (tmp_path / "two" / "policy.toml").write_text((tmp_path / "one" / "policy.toml").read_text())
    with httpx.Client(timeout=120) as http:
        try:
            one.start()
            two.start()
            assert [url for url, _ in servers(http, two)] == [dead]
            move_to(http, one, tiny_vllm.url, dead)
            wait_until(lambda: servers(http, two) == [(tiny_vllm.url, "serving")], PROPAGATION_S)
            assert chat(http, two)["model"] == TINY_MODEL_NAME

            two.kill()  # kill -9: nothing is written on the way out
            two = GatewayProcess(two.config).start()
            wait_until(lambda: servers(http, two) == [(tiny_vllm.url, "serving")], 10)
            assert chat(http, two)["model"] == TINY_MODEL_NAME
        finally:
            one.stop()
            two.stop()
