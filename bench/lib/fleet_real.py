"""What ``kv_shapes.py`` and ``pd_selective.py`` share: SmolLM2 vLLM servers publishing their
KV events, one ``semcache serve --no-launch`` per policy in front of them, the servers' own
counters, streamed requests timed to their first token and between tokens, the fleet's
saturation rate and a trace replayed at its arrival times.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backends.config import ServerRole, VllmServer
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.tokens import PromptTokenizer
from backends.kv_settings import KvSettings
from backends.launch.process import VllmProcess
from backends.models import prepare_model
from bench.lib.fleet_shapes import ShapeRequest
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import single_process_launch, test_data_dir

SERVED = "SmolLM2-135M-Instruct"
BLOCK = 32
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
"""SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x bf16."""
NO_CACHE = {"cache-control": "no-cache, no-store"}
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
)


def smollm(data_dir: Path | None = None) -> Path:
    return prepare_model("prepared:smollm2-135m-instruct", data_dir or test_data_dir(), print)


@dataclass
class Server:
    process: VllmProcess
    events: str
    replay: str
    role: ServerRole
    side_port: int | None = None


async def start_servers(
    layout: Sequence[tuple[ServerRole, str]], kv_tokens: int, max_model_len: int = 4096
) -> list[Server]:
    """One SmolLM2 server per ``(role, cores)``, each with ``kv_tokens`` of KV, block size
    32, publishing its KV events (as a launched server of ``placement = "kv"`` does), and
    ``/reset_prefix_cache`` (vLLM's dev mode)."""
    model, data_dir = smollm(), test_data_dir()
    made: list[Server] = []
    for role, cores in layout:
        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        flags = [x for pair in KvSettings().launch_flags(events, replay) for x in pair if x]
        side = free_port() if role != "both" else None
        config = VllmServer(
            url=f"http://127.0.0.1:{free_port()}",
            role=role,
            launch=single_process_launch(
                cpu_cores=cores,
                kv_cache_gib=kv_tokens * KV_BYTES_PER_TOKEN / (1 << 30),
                block_size=BLOCK,
                max_model_len=max_model_len,
                nixl_side_channel_port=side,
                extra_args=flags,
                env={"VLLM_SERVER_DEV_MODE": "1"},
            ),
        )
        process = VllmProcess(model=model, served_model=SERVED, server=config, data_dir=data_dir)
        made.append(Server(process, events, replay, role, side))
    for s in made:
        s.process.start()
    try:
        await asyncio.gather(*(s.process.wait_ready(900, None) for s in made))
    except BaseException:
        await stop_servers(made)
        raise
    return made


async def stop_servers(servers: Sequence[Server]) -> None:
    await asyncio.gather(*(s.process.stop() for s in servers), return_exceptions=True)


def client() -> httpx.AsyncClient:
    """The load's HTTP client. It drops a connection idle for 2 s: uvicorn closes one after
    5 s, and a request sent on a connection the server is closing fails before it reaches the
    gateway (a client-side race, not an answer)."""
    limits = httpx.Limits(max_connections=512, keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=600, limits=limits)


def tenants_toml(tenants: Sequence[str]) -> str:
    return "".join(f'[[auth.tokens]]\ntoken = "tok-{t}"\ntenant = "{t}"\n' for t in tenants)


def gateway_toml(
    folder: Path, servers: Sequence[Server], tenants: Sequence[str], **backend: object
) -> str:
    entries = "".join(
        f'[[backends.servers]]\nurl = "{s.process.url}"\nrole = "{s.role}"\n'
        f'kv_events = "{s.events}"\nkv_events_replay = "{s.replay}"\n'
        for s in servers
    )
    settings = "".join(f"{k} = {json.dumps(v)}\n" for k, v in backend.items())
    return f"""
data_dir = "{folder}"
[[models]]
id = "chat"
backend = "smol"
[[backends]]
kind = "vllm"
name = "smol"
served_model = "{SERVED}"
model_path = "{smollm()}"
health_interval_s = 1.0
scrape_idle_interval_s = 1.0
cache_salt_secret = "bench"
read_timeout_s = 300.0
{settings}[backends.kv]
block_size = {BLOCK}
{entries}{tenants_toml(tenants)}"""


async def start_gateways(
    servers: Sequence[Server], tenants: Sequence[str], configs: dict[str, dict[str, object]]
) -> dict[str, GatewayProcess]:
    """One gateway per name, each with its backend settings, ready (tokenizer loaded)."""
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    gateways: dict[str, GatewayProcess] = {}
    try:
        for name, settings in configs.items():
            folder = tmp / name
            folder.mkdir()
            config = folder / "gateway.toml"
            config.write_text(gateway_toml(folder, servers, tenants, **settings))
            gateways[name] = await asyncio.to_thread(GatewayProcess(config).start)
        async with httpx.AsyncClient(timeout=30) as http:
            for gw in gateways.values():
                for _ in range(600):
                    if (await http.get(f"{gw.url}/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.2)
    except BaseException:
        await stop_gateways(gateways)
        raise
    return gateways


async def stop_gateways(gateways: dict[str, GatewayProcess]) -> None:
    for gw in gateways.values():
        await asyncio.to_thread(gw.stop)


async def counters(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


async def reset(http: httpx.AsyncClient, servers: Sequence[Server]) -> None:
    """Empty every server's prefix cache; a short request per server publishes the reset."""
    for s in servers:
        answer = await http.post(f"{s.process.url}/reset_prefix_cache")
        assert answer.status_code == 200, answer.text
    for s in servers:
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 1}
        await http.post(f"{s.process.url}/v1/completions", json=body)
    await asyncio.sleep(1.0)  # the gateways' feeds apply AllBlocksCleared


@dataclass
class Timed:
    """One request as the client saw it."""

    kind: str
    ttft_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


async def stream(
    http: httpx.AsyncClient,
    gateway: str,
    request: ShapeRequest,
    *,
    model: str = "chat",
    direct: bool = False,
) -> Timed:
    """``request`` streamed through ``gateway`` (``direct``: to a vLLM server itself)."""
    body = {
        "model": model,
        "messages": request.chat(),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {} if direct else {"authorization": f"Bearer tok-{request.tenant}", **NO_CACHE}
    out = Timed(request.kind)
    started = time.perf_counter()
    last = None
    try:
        async with http.stream(
            "POST", f"{gateway}/v1/chat/completions", json=body, headers=headers
        ) as answer:
            if answer.status_code != 200:
                out.error = f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}"
                return out
            async for line in answer.aiter_lines():
                if not line.startswith("data: {") or '"content":"' not in line:
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft_s = now - started
                else:
                    out.gaps_s.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    if last is None and out.error is None:
        out.error = "no content"
    return out


async def replay(
    http: httpx.AsyncClient,
    gateway: str,
    requests: Sequence[ShapeRequest],
    arrivals: Sequence[float],
) -> tuple[list[Timed], float]:
    """Each request at its arrival time (seconds from now); ``(timings, elapsed s)``."""
    start = time.perf_counter()

    async def at(delay: float, request: ShapeRequest) -> Timed:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return await stream(http, gateway, request)

    timed = await asyncio.gather(*(at(d, r) for d, r in zip(arrivals, requests, strict=True)))
    return list(timed), time.perf_counter() - start


async def closed_loop(
    http: httpx.AsyncClient, gateway: str, requests: Sequence[ShapeRequest], clients: int
) -> float:
    """Completed requests per second with ``clients`` requests always in flight."""
    queue = list(reversed(requests))
    start = time.perf_counter()

    async def client() -> None:
        while queue:
            await stream(http, gateway, queue.pop())

    await asyncio.gather(*(client() for _ in range(clients)))
    return len(requests) / (time.perf_counter() - start)


def ceiling(requests: Sequence[ShapeRequest]) -> float:
    """The prefix-cache hit rate of one server that never evicts, as vLLM counts it (tokens
    of full blocks already seen / prompt tokens), with SmolLM2's own tokenizer."""
    tokenizer = PromptTokenizer(smollm())
    hasher = BlockHasher()
    seen: set[bytes] = set()
    hit = asked = 0
    for r in requests:
        ids = tokenizer.prompt_tokens("/v1/chat/completions", {"messages": r.chat()}) or []
        asked += len(ids)
        for block in hasher.block_hashes(ids, BLOCK, cache_salt=r.tenant):
            if block in seen:
                hit += BLOCK
            else:
                seen.add(block)
    return hit / asked if asked else 0.0
