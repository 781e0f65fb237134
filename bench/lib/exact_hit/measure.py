"""One measurement: every server started, primed and checked, the rounds of wrk runs, and the
notes on the setting that head the report."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.exact_hit.litellm_proxy import LITELLM_SPEC
from bench.lib.exact_hit.load import Results, run_rounds
from bench.lib.exact_hit.report import NONE
from bench.lib.exact_hit.servers import Bench, start_profiler, stop_profiler
from bench.lib.exact_hit.targets import answer_sizes, idle_load, not_hits
from bench.lib.exact_hit.workload import Cell, Kind
from bench.lib.support import GATEWAY_EMBEDDINGS_ID, parse_cores, stderr_printer
from bench.lib.wrk import wrk_version
from harness.metrics import metric_value

VLLM_TOKENS = "vllm:prompt_tokens_total"

say = stderr_printer("exact_hit")


@dataclass
class Run:
    """What a run measured, and what the report says about its setting."""

    results: Results
    cells: list[Cell]
    names: list[str]
    notes: list[str]
    vllm_tokens: float
    embeddings_misses: float
    """The gateways' embeddings lookups that were not hits while measuring (each would have
    encoded: the embeddings model runs in the gateway, no vLLM sees it)."""
    idle_cpu: dict[str, float]
    """CPU seconds per second each server uses with no requests (health checks, pollers)."""


async def measure(args: argparse.Namespace, litellm_missing: str | None) -> Run:
    kinds: list[Kind] = list(dict.fromkeys(args.kinds))
    cells = [Cell(kind, c) for kind in kinds for c in args.connections]
    if args.wrk_core != "none":  # this process (idle while wrk runs) off the servers' core
        os.sched_setaffinity(0, parse_cores(args.wrk_core))
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="semcache-exact-hit-")))
        bench = Bench(args, stack, tmp)
        vllm = await bench.start_vllm()
        # LiteLLM's start-up takes long: overlap it with vLLM's
        litellm = None if litellm_missing else bench.start_litellm(vllm)
        if vllm.process is not None:
            waited = await vllm.process.wait_ready(600.0, say)
            say(f"vLLM ready after {waited:.0f} s")
        gateway = await bench.start_gateway(vllm)
        targets = [gateway]
        if not args.no_tenancy:
            targets.append(await bench.start_gateway(vllm, "tenancy"))
        targets.append(await bench.start_bare(gateway))
        if litellm is not None:
            try:
                targets.append(await bench.litellm_target(*litellm))
            except RuntimeError as exc:
                litellm_missing = f"the LiteLLM proxy did not serve hits: {exc}"
                say(litellm_missing)
                await litellm[0].stop()

        sizes = {t.name: await answer_sizes(t) for t in targets}
        profiler = None
        if args.profile_gateway:
            profiler = start_profiler(gateway.pid, Path(args.profile_gateway), tmp)
            stack.callback(stop_profiler, profiler)
        for t in targets:
            t.track_cpu()
        idle_cpu = await idle_load(targets, args.idle_s)
        tokens_before = await metric_value(vllm.url, VLLM_TOKENS)
        gateways = [t for t in targets if t.name in ("gateway", "tenancy")]
        misses_before = sum([await not_hits(t) for t in gateways])
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        say(
            f"measuring {len(cells)} cells x {len(targets)} targets, wrk {args.seconds} s each, "
            f"{args.rounds} rounds (after {args.warmup_s} s of warm-up per target and kind)"
        )
        results = await run_rounds(targets, cells, args, tmp)
        elapsed = time.monotonic() - started
        load_after = os.getloadavg()[0]
        tokens = await metric_value(vllm.url, VLLM_TOKENS) - tokens_before
        misses = sum([await not_hits(t) for t in gateways]) - misses_before
        if profiler is not None:
            stop_profiler(profiler)
            say(f"py-spy profile of the gateway: {args.profile_gateway}")

    versions = ", ".join(
        f"{pkg} {importlib.metadata.version(pkg)}" for pkg in ("litestar", "uvicorn")
    )
    pinned = args.vllm_cores if vllm.process is not None else "(not started here)"
    notes = [
        f"{vllm.note}; it served {tokens:.0f} prompt tokens while measuring",
        f"embeddings model: {GATEWAY_EMBEDDINGS_ID} (the embedded all-MiniLM-L6-v2, in the "
        f"gateway's process); {misses:.0f} embeddings lookups were not hits while measuring",
        "(a) gateway: python -m server.cli serve --no-launch (uvicorn, own process), tenancy "
        "off (open, no limits, ledger and request log off); answers " + sizes["gateway"],
        "(a2) the same with tenancy on: a listed token, limits every request goes through and "
        "none reaches (RPM, TPM, concurrency, a daily USD budget), the usage ledger, the "
        f"request log to its file; answers {sizes['tenancy']}"
        if "tenancy" in sizes
        else "(a2) tenancy on: not measured (--no-tenancy)",
        "(b) bare Litestar app sending the gateway's bytes back (uvicorn, own process, run as "
        f"server.cli runs the gateway); answers {sizes['bare']}",
        f"(c) LiteLLM proxy {LITELLM_SPEC}, cache: true (type local), 1 uvicorn worker, chat "
        f"only (no embeddings model behind it: {NONE} in the tables); answers {sizes['litellm']}"
        if "litellm" in sizes
        else f"(c) LiteLLM: NOT MEASURED: {litellm_missing}",
        f"load: {wrk_version()}, 1 thread, pinned to core(s) {args.wrk_core}, a Lua script POSTing "
        f"the request with its headers; servers pinned to core(s) {args.server_core}; "
        f"{versions}",
        f"machine: {os.cpu_count()} cores SHARED WITH OTHER WORK (load average 1 min "
        f"{load_before:.1f} before, {load_after:.1f} after); vLLM pinned to core(s) {pinned}",
        "workload: one chat request (temperature 0, max_tokens 48), non-stream and stream, and "
        f"one embeddings request (one input, float vectors); cells {', '.join(kinds)}; "
        f"one {args.seconds} s wrk run per cell and target in each of {args.rounds} rounds, "
        f"the targets' order reversed every other round; {elapsed:.0f} s"
        + ("; py-spy attached to the gateway (its figures are perturbed)" if profiler else ""),
    ]
    names = [t.name for t in targets]
    return Run(results, cells, names, notes, tokens, misses, idle_cpu)
