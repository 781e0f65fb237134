"""What the DLP detectors cost: their latency on a 2k-token prompt and per streamed chunk,
and that an exact hit no rule applies to costs nothing measurable (wrk, side by side).

    .venv/bin/python bench/guard.py latency [--iterations 300]
    flock /tmp/semcache-heavy.lock .venv/bin/python bench/guard.py hits \\
        [--rounds 3] [--seconds 8] [--connections 1,8]

``latency`` runs the gateway's own inspection (``server.guard``: Presidio's analyzer with
every built-in type and the anonymizer) in this process: a 2,000-token prompt (prose with a
card number, an email and an IBAN) under a rule that redacts every type, p50 and p99 of
``Guard.inspect``; then a streamed answer of 2,000 chunks of 4 characters (a card split
across chunks) through ``StreamGuard.feed``: p50, p99 and mean per chunk.

``hits`` starts a tiny vLLM and three gateways (``semcache serve``) on one core, wrk on the
other: ``none`` runs the shipped policy (no rule anywhere), ``other`` a policy whose rules
apply to another tenant only (the request's rule is looked up and found empty), ``applies``
one whose prompt rule applies to this request (every hit inspected; no value in it). Each
is loaded in turn, per round, with the same cached chat request, two ways: ``early`` (a
byte-identical repeat: the early-hits layer answers it) and ``routed`` (with
``Cache-Control: max-age=86400``, which takes the route and the serving core). Prints req/s
per cell and the ratios to ``none``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import orjson
from prometheus_client import CollectorRegistry

from bench.lib.support import GATEWAY_ENV, REPO, gateway_ready, pct, stop_gateway, toml_value
from bench.lib.wrk import run_wrk, wrk_version
from foundation.request import RequestContext
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir
from semcache.guard_rules import BUILTIN_ENTITIES
from semcache.policy import parse_policy
from server.guard.guardrails import Scorer
from server.guard.inspector import Guard
from server.guard.metrics import GuardMetrics
from server.guard.stream import StreamGuard

WORDS = (
    "the gateway caches answers for tenants while the model streams tokens about routing "
    "latency budgets and the weather in several cities across a long afternoon of requests"
).split()


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def latency(iterations: int) -> None:
    rng = random.Random(7)
    policy = parse_policy(
        {
            "defaults": {
                "dlp": {
                    "prompt": dict.fromkeys(BUILTIN_ENTITIES, "redact"),
                    "answer": {"CREDIT_CARD": "redact"},
                }
            }
        }
    )
    rule = policy.guard_rule(policy.rule("m", "chat"), None, None)
    guard = Guard(GuardMetrics(CollectorRegistry()), Scorer.__new__(Scorer))
    # ~2,000 tokens of English prose: 1,500 words (the tiny Llama's and SmolLM2's tokenizers
    # count 1.3 to 1.4 tokens a word here)
    words = prose(rng, 1500).split()
    for at, value in (
        (200, "4111 1111 1111 1111"),
        (700, "jane.doe@example.org"),
        (1200, "DE89370400440532013000"),
    ):
        words.insert(at, value)
    text = " ".join(words)

    async def one() -> float:
        ctx = RequestContext(request_id="b")
        started = time.perf_counter()
        await guard.inspect(policy, rule, "prompt", [text], ctx)
        return time.perf_counter() - started

    async def run() -> list[float]:
        await guard.detectors(policy.guard)
        for _ in range(10):
            await one()
        return [await one() for _ in range(iterations)]

    times = asyncio.run(run())
    print(
        f"prompt: {len(text)} chars, {len(words)} words, every built-in type redacted, "
        f"{iterations} runs"
    )
    print(f"  inspect p50 {pct(times, 50) * 1e3:.2f} ms  p99 {pct(times, 99) * 1e3:.2f} ms")

    detectors = asyncio.run(guard.detectors(policy.guard))
    answer = prose(rng, 1600) + " your card 4111 1111 1111 1111 is on file " + prose(rng, 100)
    pieces = [answer[i : i + 4] for i in range(0, 8000, 4)]
    sg = StreamGuard(guard, policy, rule, detectors, RequestContext(request_id="s"))
    per_chunk = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        item = orjson.dumps(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": piece},
                        "finish_reason": "stop" if last else None,
                    }
                ]
            }
        )
        started = time.perf_counter()
        sg.feed(item)
        per_chunk.append(time.perf_counter() - started)
    print(
        f"stream: {len(pieces)} chunks of 4 chars, CREDIT_CARD redacted, window "
        f"{policy.guard.hold_back_chars} chars"
    )
    print(
        f"  per chunk p50 {pct(per_chunk, 50) * 1e6:.1f} us  p99 {pct(per_chunk, 99) * 1e6:.1f}"
        f" us  mean {statistics.fmean(per_chunk) * 1e6:.1f} us"
    )


POLICIES: dict[str, Any] = {
    "none": None,
    "other": {
        "guard": {"tenants": {"someone-else": {"dlp": {"prompt": {"CREDIT_CARD": "block"}}}}}
    },
    "applies": {
        "defaults": {"dlp": {"prompt": {"CREDIT_CARD": "redact", "EMAIL_ADDRESS": "flag"}}}
    },
}
BODY = orjson.dumps(
    {
        "model": "bench-chat",
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is prefix caching and why does it matter?"}],
    }
).decode()


def policy_toml(table: dict[str, Any]) -> str:
    """A small nested dict as TOML tables."""
    out: list[str] = ["version = 1"]

    def walk(prefix: str, node: dict[str, Any]) -> None:
        leaves = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if leaves:
            out.append(f"[{prefix}]")
            out.extend(f"{k} = {toml_value(v)}" for k, v in leaves.items())
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}.{k}" if prefix else k, v)

    walk("", table)
    return "\n".join(out) + "\n"


async def hits(rounds: int, seconds: int, connections: list[int]) -> None:
    cores = sorted(os.sched_getaffinity(0))
    server_core, wrk_core = str(cores[-1]), str(cores[0])
    data = test_data_dir()
    tmp = Path(tempfile.mkdtemp(prefix="bench-guard-"))
    vllm = await start_tiny_vllm(data, free_port(), cpu_cores=server_core)
    gateways = {}
    try:
        for name, table in POLICIES.items():
            port = free_port()
            extra = ""
            if table is not None:
                (tmp / f"{name}.toml").write_text(policy_toml(table))
                extra = f"policy = {toml_value(str(tmp / f'{name}.toml'))}\n"
            config = tmp / f"{name}-gateway.toml"
            lines = [extra.strip()] if extra else []
            config.write_text("\n".join([*lines, _gateway(tmp / name, port, vllm.url, data)]))
            gw = GatewayProcess(
                config, port, GATEWAY_ENV, cores=server_core, log=tmp / f"{name}.log"
            )
            gateways[name] = gw
            await gateway_ready(gw, 240)
        scripts = {}
        for way, headers in (("early", {}), ("routed", {"Cache-Control": "max-age=86400"})):
            lua = [
                'wrk.method = "POST"',
                f"wrk.body = [==[{BODY}]==]",
                'wrk.headers["Content-Type"] = "application/json"',
                'wrk.headers["Authorization"] = "Bearer bench"',
            ]
            lua += [f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()]
            scripts[way] = tmp / f"{way}.lua"
            scripts[way].write_text("\n".join(lua) + "\n")
        async with httpx.AsyncClient(timeout=60) as client:
            for gw in gateways.values():  # fill each cache once
                filled = await client.post(
                    gw.url + "/v1/chat/completions",
                    content=BODY,
                    headers={"authorization": "Bearer bench", "content-type": "application/json"},
                )
                filled.raise_for_status()
        rps: dict[tuple[str, str, int], list[float]] = {}
        for n in range(rounds):
            for way in scripts:
                for c in connections:
                    for name, gw in gateways.items():
                        done = run_wrk(
                            gw.url + "/v1/chat/completions",
                            scripts[way],
                            connections=c,
                            seconds=seconds,
                            core=wrk_core,
                            timeout=None,
                        )
                        if done.report.non_2xx or done.report.socket_errors:
                            raise RuntimeError(f"wrk saw errors:\n{done.output}")
                        got = done.report.rps
                        rps.setdefault((way, name, c), []).append(got)
                        print(
                            f"round {n + 1} {way:6s} c={c:<2d} {name:8s} {got:9.0f} req/s",
                            file=sys.stderr,
                        )
        print(
            f"{wrk_version()}; gateways on core {server_core}, wrk on core {wrk_core}; "
            f"{rounds} rounds of {seconds} s per cell (median req/s, ratio to `none`, "
            "rounds' ratios)"
        )
        for way in scripts:
            for c in connections:
                base = statistics.median(rps[(way, "none", c)])
                cells = []
                for name in POLICIES:
                    runs = rps[(way, name, c)]
                    ratios = [g / b for g, b in zip(runs, rps[(way, "none", c)], strict=True)]
                    cells.append(
                        f"{name} {statistics.median(runs):.0f} "
                        f"({statistics.median(runs) / base:.2f}x; "
                        f"{min(ratios):.2f}-{max(ratios):.2f})"
                    )
                print(f"  {way:6s} c={c:<2d} " + " | ".join(cells))
    finally:
        for gw in gateways.values():
            await stop_gateway(gw)
        await vllm.stop()


def _gateway(data: Path, port: int, vllm_url: str, models: Path) -> str:
    return (
        "\n".join(
            [
                f"data_dir = {toml_value(str(data))}",
                "[server]",
                'host = "127.0.0.1"',
                f"port = {port}",
                "[[models]]",
                'id = "bench-chat"',
                'backend = "bench"',
                'task = "chat"',
                "[[backends]]",
                'kind = "vllm"',
                'name = "bench"',
                f"served_model = {toml_value(TINY_MODEL_NAME)}",
                f"model_path = {toml_value(str(models / 'models' / TINY_MODEL_NAME))}",
                "[[backends.servers]]",
                f"url = {toml_value(vllm_url)}",
            ]
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--iterations", type=int, default=300)
    hit = sub.add_parser("hits")
    hit.add_argument("--rounds", type=int, default=3)
    hit.add_argument("--seconds", type=int, default=8)
    hit.add_argument("--connections", default="1,8")
    args = parser.parse_args()
    os.chdir(REPO)
    if args.what == "latency":
        latency(args.iterations)
    else:
        asyncio.run(hits(args.rounds, args.seconds, [int(c) for c in args.connections.split(",")]))


if __name__ == "__main__":
    main()
