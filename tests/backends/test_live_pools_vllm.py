"""A prefill pool that changes under load, on real vLLM (CPU): ``semcache backends scale``.

One prefill and one decode server (NixlConnector) serve the real ``semcache serve`` process
on a config file; a steady loop of concurrent chat requests runs through it while
``semcache backends scale tiny/prefill +1`` starts a second prefill server with the pool's
launch settings and adds it through the admin API (it must take prefill hops), then
``scale tiny/prefill -1`` drains it (its requests finish) and stops it. Every request of the
loop must answer 200.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.launch.process import VllmProcess
from backends.launch.scale import ScaleRecords, stop_server
from harness.gateway import GatewayProcess
from harness.metrics import metric_value
from harness.ports import free_port
from harness.vllm_process import (
    REPO_ROOT,
    SINGLE_PROCESS_ARGS,
    SINGLE_PROCESS_ENV,
    TINY_MODEL_NAME,
    start_tiny_vllm,
    tiny_llama,
)
from server.config import load_config
from tests.support.configs import write_config
from tests.support.waiting import wait_until_async

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ADMIN, USER = "scale-admin", "scale-user"
WORKERS = 3
REQUEST_TIMEOUT_S = 300.0
PROMPT = (
    "Request {n}. The cat reads a book near the window. A bird visits the old tree every day. "
    "Our team builds a small house before the rain. The teacher answers the question."
)


@dataclass
class Load:
    """A loop of concurrent chat requests through the gateway, and when each one ended."""

    url: str
    done: list[tuple[float, int]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def worker(self, client: httpx.AsyncClient, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": PROMPT.format(n=f"{w}-{n}")}],
                "max_tokens": 2,
            }
            r = await asyncio.wait_for(
                client.post(
                    f"{self.url}/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {USER}"},
                ),
                REQUEST_TIMEOUT_S,
            )
            self.done.append((time.monotonic(), r.status_code))

    async def run(self) -> None:
        # A connection per request: a kept-alive one that the gateway closes as idle while a
        # request is being sent fails in the client (a race of HTTP/1.1 keep-alive that no
        # server avoids), and the request never reaches the pools under test.
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=no_keepalive) as client:
            await asyncio.gather(*(self.worker(client, w) for w in range(WORKERS)))

    def between(self, start: float, end: float) -> int:
        return sum(1 for t, _ in self.done if start <= t <= end)


@pytest.fixture(scope="module")
async def pd_pair(data_dir: Path) -> AsyncIterator[tuple[VllmProcess, VllmProcess]]:
    common: dict[str, Any] = {"kv_cache_gib": 0.25, "max_model_len": 1024, "progress": None}
    prefill, decode = await asyncio.gather(
        start_tiny_vllm(
            data_dir, free_port(), "prefill", "0", nixl_side_channel_port=free_port(), **common
        ),
        start_tiny_vllm(
            data_dir, free_port(), "decode", "1", nixl_side_channel_port=free_port(), **common
        ),
        return_exceptions=True,
    )
    started = [p for p in (prefill, decode) if isinstance(p, VllmProcess)]
    try:
        for p in (prefill, decode):
            if isinstance(p, BaseException):
                raise p
        yield prefill, decode  # type: ignore[misc]
    finally:
        await asyncio.gather(*(p.stop() for p in started))


def disaggregated_config(
    tmp: Path, data_dir: Path, prefill: VllmProcess, decode: VllmProcess
) -> Path:
    """The gateway's config: the launch settings of the prefill server are the pool's."""
    model = data_dir / "models" / TINY_MODEL_NAME
    assert prefill.server.launch is not None
    return write_config(
        tmp,
        f"""
cache = false
[[auth.tokens]]
token = "{ADMIN}"
tenant = "ops"
roles = ["admin"]
[[auth.tokens]]
token = "{USER}"
tenant = "acme"
[[models]]
id = "tiny-chat"
backend = "tiny"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
model_path = "{model}"
revision = "test"
prefill_threshold_tokens = 32
health_interval_s = 1.0
read_timeout_s = 150.0
cache_salt_secret = "test-secret"
[[backends.servers]]
url = "{prefill.url}"
role = "prefill"
[backends.servers.launch]
cpu_cores = "0"
kv_cache_gib = 0.25
max_model_len = 1024
extra_args = {list(SINGLE_PROCESS_ARGS)!r}
env = {{ {" , ".join(f'{k} = "{v}"' for k, v in SINGLE_PROCESS_ENV.items())} }}
[[backends.servers]]
url = "{decode.url}"
role = "decode"
""",
        data_dir=tmp,
    )


@pytest.fixture(scope="module")
def gateway(
    pd_pair: tuple[VllmProcess, VllmProcess],
    data_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[GatewayProcess, Path]]:
    path = disaggregated_config(tmp_path_factory.mktemp("scale"), data_dir, *pd_pair)
    gw = GatewayProcess(path)
    try:
        yield gw.start(), path
    finally:
        gw.stop()


async def prefill_servers(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(
            f"{gw.url}/admin/backends", headers={"authorization": f"Bearer {ADMIN}"}
        )
    (pool,) = [p for p in r.json()["data"] if p["role"] == "prefill"]
    return {s["url"]: s for s in pool["servers"]}


async def scale(config: Path, gw: GatewayProcess, delta: str) -> int:
    """``semcache backends scale tiny/prefill DELTA`` as a command of its own."""
    argv = ["backends", "scale", "tiny/prefill", delta, "--config", str(config)]
    argv += ["--url", gw.url, "--token", ADMIN, "--drain-timeout", "300"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", *argv, cwd=REPO_ROOT
    )
    return await proc.wait()


async def test_a_prefill_server_added_under_load_takes_traffic_and_drains_losing_nothing(
    gateway: tuple[GatewayProcess, Path],
    pd_pair: tuple[VllmProcess, VllmProcess],
    data_dir: Path,
) -> None:
    gw, config = gateway
    prefill, _ = pd_pair
    await tiny_llama(data_dir)
    load = Load(gw.url)
    loop = asyncio.create_task(load.run())
    try:
        await wait_until_async(lambda: len(load.done) >= 2 * WORKERS, timeout_s=600)
        assert (await prefill_servers(gw))[prefill.url]["requests"] > 0

        assert await scale(config, gw, "+1") == 0
        (record,) = ScaleRecords(load_config(config).data_path(), "tiny", "prefill").read()
        added = record.url
        servers = await prefill_servers(gw)
        assert set(servers) == {prefill.url, added}
        assert servers[added]["state"] == "serving"

        async def takes_prefill_hops() -> bool:
            return (await prefill_servers(gw))[added]["requests"] >= 3

        await wait_until_async(takes_prefill_hops, timeout_s=600, interval_s=0.5)
        assert await metric_value(added, "vllm:request_success_total") > 0  # it computed them

        hops = (await prefill_servers(gw))[added]["requests"]
        drain_start = time.monotonic()
        assert await scale(config, gw, "-1") == 0
        drain_end = time.monotonic()
        assert set(await prefill_servers(gw)) == {prefill.url}
        assert ScaleRecords(load_config(config).data_path(), "tiny", "prefill").read() == []
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as client:
                await client.get(f"{added}/health")
        during = load.between(drain_start, drain_end)
        assert during > 0  # the drain ran under load
        print(
            f"\nscale: {len(load.done)} requests so far, {hops} prefill hops on the added "
            f"server, drained in {drain_end - drain_start:.1f} s with {during} answered meanwhile"
        )
        after = len(load.done)
        await wait_until_async(lambda: len(load.done) >= after + WORKERS, timeout_s=600)
    finally:
        load.stop.set()
        records = ScaleRecords(load_config(config).data_path(), "tiny", "prefill")
        for left in records.read():  # a failed test leaves no server behind
            await stop_server(left)
            records.remove(left.url)
        await loop
    statuses = [status for _, status in load.done]
    assert statuses == [200] * len(statuses)
