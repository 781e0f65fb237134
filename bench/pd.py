"""Monolithic vs disaggregated prefill/decode (1P1D) on the same hardware, one mixed workload.

Claim shown (issue 5): with long prompts mixed into a stream of short ones, a decode server
that never runs a long prefill keeps inter-token latency (ITL) steady, and TTFT of the long
prompts does not pay for the decode work of others. On this 2-core CPU with the tiny model the
figures only show the plumbing works; the same script runs on GPUs with a real model.

Two setups share the same device slots (CPU cores, or GPUs with ``--gpu``):
- monolithic: one ``role = "both"`` server per slot, least-outstanding placement;
- 1P1D: a prefill server on the first slot and a decode server on the second (NixlConnector).

Each setup is started, measured and stopped in turn (``semcache``'s own Launcher and
``VllmClient``, i.e. the gateway's routing, without the HTTP layer). The workload: ``--requests``
streamed chat requests, ``--long-share`` of them with ~``--long-tokens`` prompt tokens and the
rest ~``--short-tokens``, sent ``--concurrency`` at a time; every prompt starts with a unique
number (no prefix-cache help), ``max_tokens`` is fixed with ``ignore_eos``. TTFT: time to the
first event carrying content. ITL: gaps between the following content events. p50/p99 per
setup and prompt class are printed side by side. For 1P1D, the KV hand-off (from the prefill
answer to the decode server's first event) is printed as p50/p99/max over the prefilled
requests, with the hand-offs abandoned past the bound (``--kv-lease``: the prefill's NIXL
lease; the bound is half of it) as the gateway's ``/metrics`` counts them.

    .venv/bin/python bench/pd.py --quick                          # smoke check, ~5 min here
    .venv/bin/python bench/pd.py --quick --nixl-progress-delay-us 0 --nixl-progress-delay-us 20000
    .venv/bin/python bench/pd.py [--requests 64] [--concurrency 8] [--model smollm]
    .venv/bin/python bench/pd.py --mono-url URL --mono-url URL --prefill-url URL --decode-url URL
    .venv/bin/python bench/pd.py --ttft-640 [--requests 10] [--model smollm]

``--ttft-640`` (issue 16): one request at a time, each a fresh ~640-token chat prompt with 8
output tokens (streamed), sent both to a single ``role = "both"`` server on the first slot and
through the gateway's 1P1D path (prefill on the first slot, decode on the second, as in the
default config); all three servers are up together and the two setups take turns, so both see
the same load of a shared machine. Latency p50/max per setup, the ratio 1P1D/single, the
prefill hop and the KV hand-off. The default model here is SmolLM2-135M-Instruct, what
``make serve`` runs.

On a GPU machine (2 GPUs, vLLM with CUDA and nixl installed, a local HF model folder):

    SEMCACHE_VLLM_DEVICE=cuda .venv/bin/python bench/pd.py --gpu --slots 0,1 \\
        --model /models/Llama-3.1-8B-Instruct --served-name llama \\
        --requests 400 --concurrency 32 --long-tokens 6000 --short-tokens 100 \\
        --max-tokens 256 --max-model-len 8192 --prefill-threshold 512 [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.fleet.pool_metrics import histogram_totals
from backends.interfaces import BackendError
from backends.launch.command import Device
from backends.launch.launcher import Launcher
from backends.profiles import LaunchProfile
from backends.vllm.client import VllmClient
from bench.lib.support import pct_ms, stderr_printer
from foundation.request import RequestContext
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir, tiny_llama
from server.http.internals import write_bodies_eagerly

SHIPPED_DELAY_US = VllmLaunch().nixl_progress_delay_us

FIRST_CONTENT = re.compile(rb'"(?:content|text)":"[^"]')
SENTENCES = (
    "The cat reads a book near the window.",
    "A bird visits the old tree every day.",
    "Our team builds a small house before the rain.",
    "The teacher answers the question in the morning.",
    "My friend paints the blue sea after lunch.",
    "They follow the road to the capital of France.",
)
CHARS_PER_TOKEN = 4.0


say = stderr_printer("pd")


@dataclass
class Sample:
    kind: str
    ttft_s: float
    gaps_s: list[float]
    tokens: int
    handoff_s: float | None = None


@dataclass
class Result:
    setup: str
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: str = ""


def prompt(uid: int, tokens: int, rng: random.Random) -> str:
    words = [f"{uid:07d}."]
    while len(" ".join(words)) < tokens * CHARS_PER_TOKEN:
        words.append(rng.choice(SENTENCES))
    return " ".join(words)


def workload(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, prompt) for every request, the kinds shuffled with a fixed seed."""
    rng = random.Random(7)
    longs = round(args.requests * args.long_share)
    kinds = ["long"] * longs + ["short"] * (args.requests - longs)
    rng.shuffle(kinds)
    sizes = {"long": args.long_tokens, "short": args.short_tokens}
    base = random.randrange(1_000_000)  # unique across runs: no prefix-cache carry-over
    return [(k, prompt(base + i, sizes[k], rng)) for i, k in enumerate(kinds)]


async def one(client: VllmClient, kind: str, text: str, args: argparse.Namespace) -> Sample:
    body: dict[str, Any] = {
        "model": client.served_model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "skip_special_tokens": False,  # every generated token shows up as text
        "stream": True,
    }
    ctx = RequestContext(request_id=uuid.uuid4().hex, tenant="bench", salt_scope="bench")
    started = time.perf_counter()
    stream = await client.open_stream("/v1/chat/completions", body, ctx)
    if stream.status != 200:
        raise BackendError("broken", f"HTTP {stream.status}: {(await stream.read_all())[:200]!r}")
    stamps: list[float] = []
    buffer = b""
    async for chunk in stream.chunks():
        now = time.perf_counter()
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        stamps += [now for event in events if FIRST_CONTENT.search(event)]
    handoff = ctx.usage.pd_handoff_s
    if not stamps:  # a random-weight model may emit only tokens that decode to no text
        return Sample(kind, float("nan"), [], 0, handoff)
    return Sample(kind, stamps[0] - started, list(np.diff(stamps)), len(stamps), handoff)


async def measure(setup: str, client: VllmClient, args: argparse.Namespace) -> Result:
    items = workload(args)
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    result = Result(setup, 0.0)

    async def worker() -> None:
        while not queue.empty():
            kind, text = queue.get_nowait()
            try:
                result.samples.append(await one(client, kind, text, args))
            except BackendError as exc:
                result.errors.append(f"{kind}: {exc.message}")

    say(f"{setup}: warm-up")
    for kind, text in workload(argparse.Namespace(**{**vars(args), "requests": 4}))[:4]:
        await one(client, kind, text, args)
    say(f"{setup}: {len(items)} requests, {args.concurrency} at a time")
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    result.wall_s = time.perf_counter() - started
    stats = client.stats
    result.notes = f"hops {dict(stats.hops)}, prefill skipped {dict(stats.prefill_skipped)}"
    count, total = histogram_totals(stats.prefill_seconds)
    if count:
        result.notes += f"; prefill hop mean {total / count * 1000:.0f} ms (n={count})"
    handoffs = [s.handoff_s for s in result.samples if s.handoff_s is not None]
    if handoffs:
        result.notes += (
            f"\n{'':<12}KV hand-off p50 {pct_ms(handoffs, 50):.0f} ms, "
            f"p99 {pct_ms(handoffs, 99):.0f} ms, max {max(handoffs) * 1000:.0f} ms "
            f"(n={len(handoffs)}); over the {client.config.handoff_deadline_s:g} s bound "
            f"(lease {client.config.kv_lease_s} s): {sum(stats.handoff_over_bound.values())}"
        )
    return result


PROMPT_TOKENS = re.compile(rb'"prompt_tokens":(\d+)')


async def one_answer(client: VllmClient, text: str, args: argparse.Namespace) -> Sample:
    """``--ttft-640``: one streamed chat; ``gaps_s`` holds the whole request's latency."""
    body: dict[str, Any] = {
        "model": client.served_model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ctx = RequestContext(request_id=uuid.uuid4().hex, tenant="bench", salt_scope="bench")
    started = time.perf_counter()
    stream = await client.open_stream("/v1/chat/completions", body, ctx)
    if stream.status != 200:
        raise BackendError("broken", f"HTTP {stream.status}: {(await stream.read_all())[:200]!r}")
    first: float | None = None
    received = b""
    async for chunk in stream.chunks():
        received += chunk
        if first is None and FIRST_CONTENT.search(received):
            first = time.perf_counter()
    ended = time.perf_counter()
    found = PROMPT_TOKENS.findall(received)
    tokens = int(found[-1]) if found else 0
    ttft = (first or ended) - started
    return Sample("long", ttft, [ended - started], tokens, ctx.usage.pd_handoff_s)


async def run_interleaved(args: argparse.Namespace, slots: list[str]) -> list[Result]:
    """``--ttft-640``: a single server and a 1P1D pair up together, each prompt sent to both
    in turn (the order alternating), so both see the same load of a shared machine."""
    configs = {
        "single": backend(args, "single", [server(args, "both", slots[0])]),
        "1P1D": backend(
            args,
            "pd",
            [server(args, r, s) for r, s in (("prefill", slots[0]), ("decode", slots[1]))],
        ),
    }
    launcher = Launcher(list(configs.values()), Path(args.data_dir), progress=say)
    await launcher.start()
    write_bodies_eagerly(asyncio.get_running_loop())  # as the gateway's lifespan does
    clients = {name: VllmClient(config) for name, config in configs.items()}
    results = {name: Result(name, 0.0) for name in configs}
    try:
        rng = random.Random(7)
        base = random.randrange(1_000_000)  # unique across runs: no prefix-cache help
        texts = [prompt(base + i, args.long_tokens, rng) for i in range(args.requests + 2)]
        say(f"2 warm-up prompts, then {args.requests}, one request at a time, to both setups")
        for i, text in enumerate(texts):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                try:
                    sample = await one_answer(clients[name], text, args)
                except BackendError as exc:
                    results[name].errors.append(exc.message)
                    continue
                if i >= 2:
                    results[name].samples.append(sample)
        for name, client in clients.items():
            stats = client.stats
            notes = f"hops {dict(stats.hops)}"
            count, total = histogram_totals(stats.prefill_seconds)
            if count:
                notes += f"; prefill hop mean {total / count * 1000:.0f} ms (n={count})"
            handoffs = [s.handoff_s for s in results[name].samples if s.handoff_s is not None]
            if handoffs:
                notes += (
                    f"\n{'':<10}KV hand-off (prefill answer to decode's first event) p50 "
                    f"{pct_ms(handoffs, 50):.0f} ms, p99 {pct_ms(handoffs, 99):.0f} ms, "
                    f"max {max(handoffs) * 1000:.0f} ms (n={len(handoffs)})"
                )
            results[name].notes = notes
    finally:
        for client in clients.values():
            await client.aclose()
        await launcher.stop()
    return list(results.values())


def report_sequential(results: list[Result], args: argparse.Namespace) -> None:
    tokens = [s.tokens for r in results for s in r.samples]
    print(
        f"\nworkload: {args.requests} streamed chat requests one at a time, each prompt "
        f"({min(tokens, default=0)}-{max(tokens, default=0)} tokens, no prefix-cache help) sent "
        f"to both setups in turn, {args.max_tokens} output tokens, model {args.served_name}\n"
    )
    print(f"{'setup':<10}{'n':>4}{'p50':>10}{'max':>10}{'TTFT p50':>11}")
    for r in results:
        latencies = [s.gaps_s[0] for s in r.samples]
        print(
            f"{r.setup:<10}{len(latencies):>4}{pct_ms(latencies, 50):>8.0f}ms"
            f"{max(latencies, default=float('nan')) * 1000:>8.0f}ms"
            f"{pct_ms([s.ttft_s for s in r.samples], 50):>9.0f}ms"
        )
        if r.errors:
            print(f"{'':<10}errors: {len(r.errors)} (first: {r.errors[0]})")
        print(f"{'':<10}{r.notes}")
    by_setup = {r.setup: [s.gaps_s[0] for s in r.samples] for r in results}
    if by_setup.get("single") and by_setup.get("1P1D"):
        ratio = pct_ms(by_setup["1P1D"], 50) / pct_ms(by_setup["single"], 50)
        print(f"\n1P1D / single, p50 latency: {ratio:.2f}x")


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"\nworkload: {args.requests} streamed chat requests, {args.concurrency} concurrent, "
        f"{args.long_share:.0%} long (~{args.long_tokens} tokens) / short (~{args.short_tokens}), "
        f"max_tokens {args.max_tokens}, model {args.model}\n"
    )
    header = (
        f"{'setup':<12}{'prompts':<8}{'n':>5}{'TTFT p50':>11}{'TTFT p99':>11}"
        f"{'ITL p50':>10}{'ITL p99':>10}{'tok/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        for kind in ("long", "short", "all"):
            chosen = [s for s in r.samples if kind in ("all", s.kind) and s.tokens]
            gaps = [g for s in chosen for g in s.gaps_s]
            tokens = sum(s.tokens for s in chosen)
            rate = f"{tokens / r.wall_s:9.0f}" if kind == "all" else " " * 9
            ttfts = [s.ttft_s for s in chosen]
            print(
                f"{r.setup:<12}{kind:<8}{len(chosen):>5}"
                f"{pct_ms(ttfts, 50):>9.0f}ms{pct_ms(ttfts, 99):>9.0f}ms"
                f"{pct_ms(gaps, 50):>8.1f}ms{pct_ms(gaps, 99):>8.1f}ms{rate}"
            )
        empty = sum(1 for s in r.samples if not s.tokens)
        if empty:
            print(f"{'':<12}answers without visible text (left out): {empty}")
        if r.errors:
            print(f"{'':<12}errors: {len(r.errors)} (first: {r.errors[0]})")
        print(f"{'':<12}{r.notes}")


# -- the two setups ----------------------------------------------------------------------------


def server(
    args: argparse.Namespace, role: str, slot: str, delay_us: int | None = None
) -> VllmServer:
    env = {"CUDA_VISIBLE_DEVICES": slot} if args.gpu else {}
    return VllmServer(
        url=f"http://127.0.0.1:{free_port()}",
        role=role,  # type: ignore[arg-type]
        launch=VllmLaunch(
            cpu_cores=None if args.gpu else slot,
            kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.max_model_len,
            nixl_side_channel_port=free_port() if role != "both" else None,
            nixl_progress_delay_us=SHIPPED_DELAY_US if delay_us is None else delay_us,
            env=env,
        ),
    )


def backend(args: argparse.Namespace, name: str, servers: list[VllmServer]) -> VllmBackendConfig:
    roles = {s.role for s in servers}
    profile = LaunchProfile(kv_cache_dtype=args.kv_cache_dtype) if args.gpu else None
    return VllmBackendConfig(
        name=name,
        served_model=args.served_name,
        model_path=args.model_path,
        servers=servers,
        prefill_threshold_tokens=args.prefill_threshold,
        max_inflight_per_server=max(256, args.concurrency),
        health_interval_s=5.0,
        cache_salt_secret="bench",
        kv_lease_s=args.kv_lease,
        profiles={r: profile for r in roles} if profile else {},
    )


async def run_setup(
    name: str, config: VllmBackendConfig, args: argparse.Namespace, launch: bool
) -> Result:
    device: Device | None = "cuda" if args.gpu else None
    launcher = Launcher([config], Path(args.data_dir), progress=say, device=device)
    if launch:
        await launcher.start()
    write_bodies_eagerly(asyncio.get_running_loop())  # as the gateway's lifespan does
    client = VllmClient(config)
    try:
        return await measure(name, client, args)
    finally:
        await client.aclose()
        await launcher.stop()


async def run(args: argparse.Namespace) -> None:
    slots = args.slots.split(",")
    if len(slots) < 2:
        raise SystemExit("--slots needs two device slots (cores or GPUs)")
    if args.model == "tiny":
        args.model_path = str(await tiny_llama(Path(args.data_dir)))
        args.served_name = args.served_name or TINY_MODEL_NAME
    elif args.model == "smollm":
        args.model_path = "prepared:smollm2-135m-instruct"
        args.served_name = args.served_name or "SmolLM2-135M-Instruct"
    else:
        args.model_path = args.model
        args.served_name = args.served_name or Path(args.model).name
    results = []
    if args.ttft_640:
        report_sequential(await run_interleaved(args, slots), args)
        return
    if args.mono_url:
        mono = [VllmServer(url=u) for u in args.mono_url]
    else:
        mono = [server(args, "both", slot) for slot in slots[:2]]
    results.append(
        await run_setup("monolithic", backend(args, "mono", mono), args, not args.mono_url)
    )
    if args.prefill_url and args.decode_url:
        pd = [VllmServer(url=args.prefill_url, role="prefill")]
        pd += [VllmServer(url=args.decode_url, role="decode")]
        results.append(await run_setup("1P1D", backend(args, "pd", pd), args, False))
    else:
        for delay in args.nixl_progress_delay_us or [SHIPPED_DELAY_US]:
            pd = [
                server(args, r, s, delay) for r, s in (("prefill", slots[0]), ("decode", slots[1]))
            ]
            name = "1P1D" if not args.nixl_progress_delay_us else f"1P1D {delay}us"
            results.append(await run_setup(name, backend(args, "pd", pd), args, True))
    report(results, args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm | an HF folder / prepared:NAME")
    ap.add_argument("--served-name", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--short-tokens", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-threshold", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU only")
    ap.add_argument("--slots", default="0,1", help="two CPU cores, or two GPUs with --gpu")
    ap.add_argument("--gpu", action="store_true", help="servers on GPUs (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="GPU only")
    ap.add_argument("--mono-url", action="append", help="running monolithic servers")
    ap.add_argument("--prefill-url", help="a running prefill server (kv_producer)")
    ap.add_argument("--decode-url", help="a running decode server (kv_consumer)")
    ap.add_argument("--kv-lease", type=int, default=30, help="the prefill's NIXL KV lease, seconds")
    ap.add_argument("--data-dir", default=str(test_data_dir()))
    ap.add_argument("--quick", action="store_true", help="24 requests, 4 concurrent")
    ap.add_argument(
        "--ttft-640",
        action="store_true",
        help="issue 16's request (~640-token prompt, 8 tokens) one at a time: one single "
        "server vs 1P1D (default here: --requests 10, --model smollm)",
    )
    ap.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        action="append",
        help="launched 1P1D servers' NIXL progress-thread sleep; repeat to compare settings",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.concurrency = 24, 4
    if args.ttft_640:
        defaults = build_parser().parse_args([])
        for name, value in (("requests", 10), ("model", "smollm")):
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
        args.long_tokens, args.max_tokens = 690, 8  # ~640 SmolLM2 tokens with the template
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
