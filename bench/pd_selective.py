"""Selective prefill/decode against always-P/D and never-P/D on the long-history shape, on real
vLLM servers, side by side in one run.

One prefill and two decode SmolLM2-135M-Instruct servers (NixlConnector; prefill on the first
of ``--cores``, decode on the others; 8,192 tokens of KV each, publishing their KV events) and
three ``semcache serve --no-launch`` in front of them, all with KV placement, differing only
in ``prefill_threshold_tokens``, which the index applies to the tokens the chosen decode
server lacks: ``always`` (0), ``never`` (10**9) and ``selective`` (``--threshold``, default
the measured break-even). The bench process, its load and the gateways run on
``--client-core``.

1. The hop, measured: fresh 1,024-token prompts one at a time, prefilled on the prefill
   server then decoded with its KV (the decode server's first token after the prefill answer,
   beyond a cached prompt's) against the same prompt's cold prefill alone; kept in the
   simulator's calibration (``.data/bench/calibration.json``, from ``kv_shapes.py
   --calibrate``), which is printed.
2. The break-even: the most uncached tokens a decode server prefills itself while its
   streams stay within the ITL SLO (a step plus that prefill, from the calibration); past it
   the hop pays. SLOs: TTFT ≤ 1.5 x (a RAG prompt's prefill alone + the hop), each request's
   inter-token gap p99 ≤ ``--slo-itl-ms``.
3. Saturation: the shape's first requests in a closed loop of 4 per server through
   ``always``; arrivals are then Poisson at the shape's fraction of it.
4. ``--runs`` rounds, each running the three modes on the same trace (prefix caches reset
   before each; the order rotates): TTFT p50/p90 (all, turns, fresh prompts), ITL p99,
   goodput (requests within both SLOs), hops and failures.

    flock /tmp/semcache-heavy.lock timeout 3600 .venv/bin/python -m bench.pd_selective [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_shapes import CALIBRATION, ratio_interval, save
from bench.lib import fleet_calibration, fleet_real, fleet_shapes
from bench.lib.fleet_calibration import Calibration
from bench.lib.support import bootstrap_interval, pct

MODES = ("always", "never", "selective")


async def measure_hop(http: httpx.AsyncClient, prefill: str, decode: str, n: int = 4) -> float:
    """The decode server's first token after a prefill answer (the decode request, the KV
    pull, its first step): what the hop adds to a prefill. Median of ``n`` fresh prompts."""
    added = []
    for i in range(n):
        text = fleet_shapes.words(f"hop{i}-{time.time()}", 1024)
        messages = [{"role": "user", "content": text}]
        body = {"model": fleet_real.SERVED, "messages": messages, "max_tokens": 1}
        answer = await http.post(
            f"{prefill}/v1/chat/completions",
            json={**body, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = answer.json()["kv_transfer_params"]
        started = time.perf_counter()
        first = await first_token(http, decode, {**body, "kv_transfer_params": params})
        added.append((first - started) * 1000)
    return statistics.median(added)


async def first_token(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True, "max_tokens": 2}
    ) as answer:
        async for line in answer.aiter_lines():
            if '"content":"' in line:
                return time.perf_counter()
    raise AssertionError("no token")


def summarise(timed: list[fleet_real.Timed], slo_ttft: float, slo_itl: float) -> dict[str, Any]:
    ok = [t for t in timed if t.error is None]
    itl = [pct(t.gaps_s, 99) if t.gaps_s else 0.0 for t in ok]
    good = sum(1 for t, i in zip(ok, itl, strict=True) if t.ttft_s <= slo_ttft and i <= slo_itl)
    return {
        "ttfts": [t.ttft_s for t in ok],
        "turns": [t.ttft_s for t in ok if t.kind != "fresh"],
        "fresh": [t.ttft_s for t in ok if t.kind == "fresh"],
        "itl": itl,
        "good": good / len(timed),
        "errors": [t.error for t in timed if t.error is not None],
    }


async def hops(http: httpx.AsyncClient, gateway: str) -> float:
    for line in (await http.get(f"{gateway}/metrics")).text.splitlines():
        if line.startswith("semcache_pd_hops_total{") and 'hop="prefill"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def main_async(args: argparse.Namespace) -> int:
    cores = args.cores.split(",")
    layout = [("prefill", cores[0]), *(("decode", c) for c in cores[1:])]
    servers = await fleet_real.start_servers(layout, args.kv_tokens)  # type: ignore[arg-type]
    gateways: dict[str, Any] = {}
    try:
        async with fleet_real.client() as http:
            old = fleet_calibration.load(CALIBRATION)
            hop = await measure_hop(http, servers[0].process.url, servers[1].process.url)
            cal = Calibration(
                old.base_ms, old.per_token_ms, old.quadratic_ms, old.step_ms, hop,
                f"{old.source.split('; hop:')[0]}; hop: pd_selective, {time.strftime('%Y-%m-%d')}",
            )  # fmt: skip
            cal.save(CALIBRATION)
            threshold = (
                args.threshold if args.threshold is not None else cal.break_even(args.slo_itl_ms)
            )
            shape = fleet_shapes.build(
                "long-history", len(servers) - 1, args.kv_tokens, args.requests, args.seed
            )
            rag = int(str(shape.params["RAG tokens"]))
            slo_ttft = 1.5 * (cal.prefill_ms(rag) + cal.hop_ms) / 1000
            slo_itl = args.slo_itl_ms / 1000
            print(
                f"calibration: {cal.line()}\nbreak-even: {cal.break_even(args.slo_itl_ms)}"
                f" uncached tokens (the most a decode server prefills within the ITL SLO);"
                f" selective threshold {threshold}\nSLO: TTFT <= {slo_ttft * 1000:.0f} ms,"
                f" ITL p99 <= {args.slo_itl_ms:.0f} ms",
                flush=True,
            )
            tenants = sorted({r.tenant for r in shape.requests})
            settings = {"always": 0, "never": 10**9, "selective": threshold}
            gateways = await fleet_real.start_gateways(
                servers,
                tenants,
                {
                    m: {"placement": "kv", "prefill_threshold_tokens": t}
                    for m, t in settings.items()
                },
            )
            await fleet_real.reset(http, servers)
            clients = 4 * len(servers)
            sat = await fleet_real.closed_loop(
                http, gateways["always"].url, shape.requests[: args.saturation_requests], clients
            )
            fraction = args.rate_fraction or shape.rate_fraction
            rate = fraction * sat
            arrivals = fleet_shapes.arrivals(len(shape.requests), rate, args.seed)
            print(
                f"\n== long-history, 1P{len(servers) - 1}D: {len(shape.requests)} requests,"
                f" {shape.params}; saturation {sat:.2f} req/s (closed loop of {clients},"
                f" always-P/D), arrivals at {fraction:.2f}x = {rate:.2f} req/s",
                flush=True,
            )
            results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for run in range(args.runs):
                order = MODES[run % 3 :] + MODES[: run % 3]
                for mode in order:
                    await fleet_real.reset(http, servers)
                    before = await hops(http, gateways[mode].url)
                    timed, _ = await fleet_real.replay(
                        http, gateways[mode].url, shape.requests, arrivals
                    )
                    r = summarise(timed, slo_ttft, slo_itl)
                    r["hops"] = (await hops(http, gateways[mode].url) - before) / len(timed)
                    results[mode].append(r)
                    print(
                        f"  round {run} {mode:>9}: TTFT p50 {pct(r['ttfts'], 50) * 1000:.0f}"
                        f" p90 {pct(r['ttfts'], 90) * 1000:.0f} ms, turns p50"
                        f" {pct(r['turns'], 50) * 1000:.0f} ms, ITL p99"
                        f" {pct(r['itl'], 99) * 1000:.0f} ms, goodput {r['good']:.2f},"
                        f" hops {r['hops']:.2f}, failed {len(r['errors'])}",
                        flush=True,
                    )
            keep = {"saturation": sat, "rate": rate, "threshold": threshold, "params": shape.params}
            save(Path(".data/bench/pd_selective.json"), {**keep, "runs": results})
            return report(results)
    finally:
        await fleet_real.stop_gateways(gateways)
        await fleet_real.stop_servers(servers)


def report(results: dict[str, list[dict[str, Any]]]) -> int:
    print(
        f"\n{'mode':>10} {'TTFT p50':>9} {'p90':>7} {'turn p50':>9} {'fresh p50':>10}"
        f" {'ITL p99':>8} {'goodput (rounds)':>24} {'hops':>5} {'failed':>6}"
    )
    pooled: dict[str, dict[str, list[float]]] = {}
    for mode, runs in results.items():
        pooled[mode] = {
            k: [x for r in runs for x in r[k]] for k in ("ttfts", "turns", "fresh", "itl")
        }
        p = pooled[mode]
        goods = [r["good"] for r in runs]
        print(
            f"{mode:>10} {pct(p['ttfts'], 50) * 1000:>7.0f}ms {pct(p['ttfts'], 90) * 1000:>5.0f}ms"
            f" {pct(p['turns'], 50) * 1000:>7.0f}ms {pct(p['fresh'], 50) * 1000:>8.0f}ms"
            f" {pct(p['itl'], 99) * 1000:>6.0f}ms"
            f" {statistics.mean(goods):>6.2f} ({' '.join(f'{g:.2f}' for g in goods)})".ljust(26)
            + f" {statistics.mean(r['hops'] for r in runs):>5.2f}"
            f" {sum(len(r['errors']) for r in runs):>6}"
        )
    sel, alw = pooled["selective"]["ttfts"], pooled["always"]["ttfts"]
    ratio = pct(sel, 50) / pct(alw, 50)
    low, high = ratio_interval(sel, alw, 50)
    g = {m: np.array([r["good"] for r in rs]) for m, rs in results.items()}

    def diff(other: str) -> tuple[float, float]:
        a, b = g["selective"], g[other]
        return bootstrap_interval(
            lambda rng: float(
                a[rng.integers(0, len(a), len(a))].mean()
                - b[rng.integers(0, len(b), len(b))].mean()
            )
        )

    failed = sum(len(r["errors"]) for rs in results.values() for r in rs)
    ok = ratio <= 0.8 and all(g["selective"].mean() >= g[m].mean() for m in ("always", "never"))
    print(
        f"selective / always: TTFT p50 {ratio:.2f}x [{low:.2f}, {high:.2f}];"
        f" goodput selective - always {g['selective'].mean() - g['always'].mean():+.2f}"
        f" {diff('always')}, - never {g['selective'].mean() - g['never'].mean():+.2f}"
        f" {diff('never')}; failed {failed}\ntarget (TTFT p50 <= 0.8x always, goodput >="
        f" both): {'MET' if ok and not failed else 'NOT MET'}"
    )
    return 0 if ok and not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=90)
    parser.add_argument("--saturation-requests", type=int, default=36)
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--cores", default="0,1,1", help="prefill, then the decode servers")
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--threshold", type=int, help="default: the break-even")
    parser.add_argument("--slo-itl-ms", type=float, default=250.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--rate-fraction",
        type=float,
        help="arrivals as this fraction of the measured saturation (default: the shape's, 0.7)",
    )
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
