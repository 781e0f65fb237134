"""vLLM killed (SIGKILL) mid-stream under the ``semcache serve`` process: the client gets an
error event, nothing partial is stored, and the next request is served by the pool's other
server."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.config import VllmServer
from backends.fleet.placement import rendezvous_order
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm
from tests.conftest import gateway_config
from tests.server.chaos.common import every_tier_policy, metric
from tests.support.configs import write_policy

pytestmark = pytest.mark.slow


def long_seeded(text: str) -> dict[str, Any]:
    """Cacheable (seeded) and long: a stream to cut."""
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1800,
        "n": 4,  # four choices: work enough that the kill lands mid-answer
        "temperature": 1.0,
        "seed": 21,  # a fixed seed: cacheable under the policy's deterministic_only
        "ignore_eos": True,
        "stream": True,
    }


def test_vllm_killed_mid_stream_error_event_nothing_stored_next_served(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess
) -> None:
    doomed = asyncio.run(start_tiny_vllm(data_dir, free_port(), progress=None))
    config = gateway_config(
        tmp_path,
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        policy=str(write_policy(tmp_path, every_tier_policy())),
    )
    config.backends[0].servers = [VllmServer(url=doomed.url), VllmServer(url=tiny_vllm.url)]
    gw = GatewayProcess(write_config_toml(config, tmp_path / "gateway.toml")).start()
    # x-session-affinity places by rendezvous hashing: a session whose first choice is the
    # doomed server puts the stream there, and spills to the other once it is gone.
    session = next(
        f"s{i}"
        for i in itertools.count()
        if rendezvous_order(f"s{i}", [doomed, tiny_vllm])[0] is doomed
    )
    affinity = {"x-session-affinity": session}
    try:
        with httpx.Client(timeout=120) as http:
            cut = long_seeded(f"Write a long story {uuid.uuid4().hex}.")
            stores = metric(gw.url, "semcache_exact_stores_total")
            with http.stream(
                "POST", f"{gw.url}/v1/chat/completions", json=cut, headers=affinity
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                doomed.kill()
                events = [orjson.loads(first[6:])]
                events += [
                    line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:])
                    for line in lines
                    if line.startswith("data: ")
                ]
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            finished = [
                e
                for e in events
                if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
            ]
            assert len(errors) == 1 and not finished, events[-3:]
            assert errors[0]["error"]["code"] == "backend_stream_broken"
            assert metric(gw.url, "semcache_exact_stores_total") == stores  # nothing partial

            # The same request again: a miss (nothing was stored under its key), answered
            with http.stream(
                "POST", f"{gw.url}/v1/chat/completions", json=cut, headers=affinity
            ) as r:
                assert r.status_code == 200
                assert r.headers["cf-aig-cache-status"] == "MISS"
            # and short requests are served by the other server, the dead one ejected
            served = 0
            for i in range(5):
                short = {
                    **cut,
                    "stream": False,
                    "max_tokens": 8,
                    "messages": [
                        {"role": "user", "content": f"after the kill {i} {uuid.uuid4().hex}"}
                    ],
                }
                r = http.post(f"{gw.url}/v1/chat/completions", json=short, headers=affinity)
                served += r.status_code == 200 and bool(r.json()["choices"][0]["finish_reason"])
            assert served == 5
    finally:
        gw.stop()
        asyncio.run(doomed.stop())
    print(
        f"\nFIGURE vLLM killed: 1 of 1 cut streams ended with an error event after "
        f"{len(events) - 1} chunks, 0 partial answers stored, {served} of 5 next requests "
        "served by the other server"
    )
