"""Anthropic's Messages API through the gateway against its OpenAI chat route, side by side.

Claims checked (issue 49): (1) a ``/v1/messages`` exact-cache hit serves within 10 % of the
requests/s of the equivalent ``/v1/chat/completions`` hit (the same stored answer, translated
on its way out), JSON and SSE, at 1 and 16 connections; (2) on a miss, the translation adds at
most 1 ms to the time to the first streamed token at p50.

One gateway (``semcache serve --no-launch``, pinned to ``--server-core``) in front of a tiny
vLLM (``--vllm-cores``); wrk (one thread, pinned to ``--wrk-core``) POSTs one fixed request
per cell, the two routes alternating within each round and their order flipped every other
round. Before measuring each request is sent until it is a hit; while measuring, wrk must
see no non-2xx answer and vLLM's prompt-token counter must not move. Then the misses: each
round sends one streamed request of each route with a prompt never seen (so vLLM computes
both), one at a time, in alternating order, and times the first text delta of each
(``content_block_delta`` / a chunk with ``delta.content``); the figure is the p50 of the
per-round differences, with a bootstrap interval.

    .venv/bin/python bench/messages.py            # 5 s runs, 6 rounds; 200 miss pairs
    .venv/bin/python bench/messages.py --quick    # 2 s runs, 3 rounds; 60 miss pairs
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import (
    GATEWAY_ENV,
    GATEWAY_MODEL_ID,
    affinity,
    bootstrap_interval,
    exit_status,
    gateway_ready,
    gateway_toml,
    parse_cores,
    stderr_printer,
    stop_gateway,
)
from bench.lib.wrk import run_wrk, wrk_version
from foundation.sse import SSEReader
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir

say = stderr_printer("messages")
SYSTEM = "You are a concise assistant."
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 48
KEY = "sk-bench-messages"
MESSAGES = {
    "model": GATEWAY_MODEL_ID,
    "system": SYSTEM,
    "messages": [{"role": "user", "content": QUESTION}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
}
CHAT = {
    "model": GATEWAY_MODEL_ID,
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
}
ROUTES = {"messages": "/v1/messages", "chat": "/v1/chat/completions"}


def body(route: str, stream: bool, question: str = QUESTION) -> bytes:
    doc = dict(MESSAGES if route == "messages" else CHAT)
    if route == "messages":
        doc["messages"] = [{"role": "user", "content": question}]
    else:
        doc["messages"] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ]
    if stream:
        doc["stream"] = True
    return orjson.dumps(doc)


def headers(route: str) -> dict[str, str]:
    if route == "messages":
        return {
            "x-api-key": KEY,
            "anthropic-version": "2023-06-01",
            "content-type": "application/json",
        }
    return {"authorization": f"Bearer {KEY}", "content-type": "application/json"}


def wrk_script(route: str, stream: bool) -> str:
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{body(route, stream).decode()}]==]"]
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in headers(route).items()]
    return "\n".join(lines) + "\n"


async def prime(http: httpx.AsyncClient, url: str) -> None:
    """Send each request until the gateway answers it from the cache."""
    for route in ROUTES:
        for stream in (False, True):
            for _ in range(5):
                r = await http.post(
                    url + ROUTES[route], content=body(route, stream), headers=headers(route)
                )
                r.raise_for_status()
                if r.headers.get("cf-aig-cache-status") == "HIT":
                    break
            else:
                raise RuntimeError(f"{route} stream={stream} never became a hit")


def has_text(route: str, payload: bytes) -> bool:
    """The event carries answer text (a ``text_delta``, or a chunk's non-empty content)."""
    if route == "messages":
        return b'"text_delta"' in payload
    if payload == b"[DONE]":
        return False
    choices = orjson.loads(payload).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def first_text_s(http: httpx.AsyncClient, url: str, route: str, question: str) -> float:
    """Seconds to the first text delta of a streamed miss."""
    reader = SSEReader()
    started = time.perf_counter()
    found = None
    async with http.stream(
        "POST", url + ROUTES[route], content=body(route, True, question), headers=headers(route)
    ) as r:
        r.raise_for_status()
        assert r.headers["cf-aig-cache-status"] == "MISS", r.headers
        async for chunk in r.aiter_raw():
            if found is None and any(has_text(route, p) for p in reader.feed(chunk)):
                found = time.perf_counter() - started
    if found is None:
        raise RuntimeError(f"{route}: no text in the stream")
    return found


async def run(args: argparse.Namespace) -> bool:
    data_dir = Path(args.data_dir)
    work = Path(tempfile.mkdtemp(prefix="bench-messages-"))
    vllm_cores = parse_cores(args.vllm_cores)
    with affinity(vllm_cores):
        vllm = await start_tiny_vllm(data_dir, free_port(), progress=None)
    port = free_port()
    config = work / "gateway.toml"
    config.write_text(
        gateway_toml(
            data_dir=work / "data",
            port=port,
            vllm_url=vllm.url,
            served=TINY_MODEL_NAME,
            model=data_dir / "models" / TINY_MODEL_NAME,
        )
    )
    gateway = GatewayProcess(
        config, port, GATEWAY_ENV, cores=parse_cores(args.server_core), log=work / "gateway.log"
    )
    try:
        await gateway_ready(gateway, 120)
        url = gateway.url
        async with httpx.AsyncClient(timeout=60) as http:
            await prime(http, url)
            return await measure(args, http, url, vllm.url, work)
    finally:
        await stop_gateway(gateway)
        await vllm.stop()


async def measure(
    args: argparse.Namespace, http: httpx.AsyncClient, url: str, vllm_url: str, work: Path
) -> bool:
    os.sched_setaffinity(0, parse_cores(args.wrk_core))
    print(f"# bench/messages.py, {wrk_version()}, {args.seconds} s runs, {args.rounds} rounds")
    met = True
    prompt_tokens = parse_metric(
        (await http.get(f"{vllm_url}/metrics")).text, "vllm:prompt_tokens_total"
    )
    print(
        "\n| kind | connections | /v1/messages req/s | /v1/chat/completions req/s | ratio "
        "| target |"
    )
    print("|---|---|---|---|---|---|")
    for stream in (False, True):
        for connections in args.connections:
            rps: dict[str, list[float]] = {route: [] for route in ROUTES}
            scripts = {}
            for route in ROUTES:
                scripts[route] = work / f"{route}-{stream}.lua"
                scripts[route].write_text(wrk_script(route, stream))
            for n in range(args.rounds):
                order = list(ROUTES) if n % 2 == 0 else list(reversed(ROUTES))
                for route in order:
                    report = run_wrk(
                        url + ROUTES[route],
                        scripts[route],
                        connections=connections,
                        seconds=args.seconds,
                        core=args.wrk_core,
                    ).report
                    errors = report.non_2xx + report.socket_errors
                    if errors:
                        raise RuntimeError(f"{route}: {errors} errors under wrk")
                    rps[route].append(report.rps)
            ratio = float(np.median(rps["messages"]) / np.median(rps["chat"]))
            ok = ratio >= 0.9
            met &= ok
            kind = "SSE" if stream else "JSON"
            print(
                f"| {kind} | {connections} | {np.median(rps['messages']):.0f} | "
                f"{np.median(rps['chat']):.0f} | {ratio:.2f}x | "
                f"≥ 0.90: {'met' if ok else 'NOT MET'} |"
            )
    after = parse_metric((await http.get(f"{vllm_url}/metrics")).text, "vllm:prompt_tokens_total")
    if after != prompt_tokens:
        print("ERROR: vLLM computed prompts while measuring hits: not every answer was a hit")
        met = False

    diffs, firsts = [], {route: [] for route in ROUTES}
    for n in range(args.misses):
        order = list(ROUTES) if n % 2 == 0 else list(reversed(ROUTES))
        got = {}
        for route in order:
            question = f"{QUESTION} (round {n}, {route})"
            got[route] = await first_text_s(http, url, route, question)
            firsts[route].append(got[route])
        diffs.append(got["messages"] - got["chat"])
    d = np.array(diffs) * 1000
    low, high = bootstrap_interval(lambda rng: float(np.median(d[rng.integers(0, len(d), len(d))])))
    p50 = float(np.median(d))
    ok = p50 <= 1.0
    met &= ok
    print(
        f"\nMiss, time to the first text delta, p50: /v1/messages "
        f"{np.median(firsts['messages']) * 1000:.2f} ms, /v1/chat/completions "
        f"{np.median(firsts['chat']) * 1000:.2f} ms; added by the translation (paired "
        f"differences, {len(d)} pairs): {p50:+.2f} ms [{low:+.2f}, {high:+.2f}] "
        f"(target ≤ 1 ms: {'met' if ok else 'NOT MET'})"
    )
    return met


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--misses", type=int, default=200, help="miss pairs timed")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quick", action="store_true", help="2 s runs, 3 rounds, 60 miss pairs")
    ap.add_argument("--server-core", default="0")
    ap.add_argument("--wrk-core", default="1", help="wrk and this script's client")
    ap.add_argument("--vllm-cores", default="1")
    ap.add_argument("--data-dir", default=str(test_data_dir()))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.misses = 2, 3, 60
    if shutil.which("wrk") is None:
        say("wrk is missing: bash scripts/wrk.sh install")
        return 1
    return exit_status(run(args), say)


if __name__ == "__main__":
    sys.exit(main())
