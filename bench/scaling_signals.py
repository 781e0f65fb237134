"""Each pool's scaling signal moves with the load it stands for (issue 51).

Runs ``semcache serve`` on the embedded default (SmolLM2-135M-Instruct on one prefill and
one decode vLLM server, NIXL between them, each pinned to a core) and drives it through four
phases, each ``--seconds`` long: quiet, a burst of long prompts, quiet, a burst of long
answers. The long-prompt burst keeps ``--concurrency`` streams of ~``--prompt-tokens``-token
prompts (each unique: no cache, no prefix help) asking for ``--prompt-answer-tokens`` tokens;
the long-answer burst keeps as many streams of short prompts (under the prefill threshold:
decode alone) asking for ``--answer-tokens`` tokens (``ignore_eos``). Every ``--every``
seconds it reads the gateway's ``/metrics`` and computes, per pool, what the Prometheus
adapter serves the HPAs (deploy/k8s/prometheus-adapter/values.yaml) and the other pool
signals:

- queue: the mean time requests waited inside the pool's servers since the last read
  (``semcache_pool_queue_time_seconds``: Δsum / Δcount);
- depth: ``semcache_pool_queue_depth`` (gateway queue + ``vllm:num_requests_waiting``);
- kv: ``semcache_pool_kv_cache_usage`` (mean over the servers, 0..1);
- ttft: mean time to first token inside the servers since the last read;
- running: the requests the pool's servers run (``vllm:num_requests_running``, summed);
- inflight: requests the gateway has open on the pool (a P/D request holds its decode slot
  from before its prefill hop).

It prints, per phase and pool, the mean and the highest value of each signal, then the ratio
of each HPA signal between the burst it stands for and the other burst.

    .venv/bin/python bench/scaling_signals.py [--seconds 40] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.gateway import GatewayProcess
from server.config import DEFAULT_CONFIG

POOLS = ("prefill", "decode")
SIGNALS = ("queue", "depth", "kv", "ttft", "running", "inflight")
HPA_SIGNAL = {"prefill": "queue", "decode": "kv"}
"""What each pool's HPA scales on (deploy/k8s/prefill.yaml, decode.yaml)."""
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda sigma omega".split()


def say(message: str) -> None:
    print(f"[scaling_signals] {message}", file=sys.stderr, flush=True)


def write_config(folder: Path, health_interval_s: float) -> Path:
    """The shipped default with its data in ``folder`` and a shorter health interval (each
    read of vLLM's gauges is one health check)."""
    text = DEFAULT_CONFIG.read_text()
    text = text.replace('data_dir = ".data"', f'data_dir = "{folder}"')
    text = text.replace("health_interval_s = 5.0", f"health_interval_s = {health_interval_s}")
    path = folder / "config.toml"
    path.write_text(text)
    return path


@dataclass
class Sample:
    at: float
    values: dict[str, float]
    """``<family>{role}`` → value, for the pool families read."""


RUNNING = "semcache_upstream_vllm_num_requests_running"
"""Each server's ``vllm:num_requests_running``, as the gateway last scraped it."""


def read(text: str) -> dict[str, float]:
    """The pool families' samples by ``name{role}``, and each pool's servers' running
    requests summed (``RUNNING{role}``)."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "role" not in s.labels or "state" in s.labels:
                continue
            if family.name.startswith("semcache_pool_"):
                out[f"{s.name}{{{s.labels['role']}}}"] = s.value
            elif s.name == RUNNING:
                out[f"{RUNNING}{{{s.labels['role']}}}"] += s.value
    return dict(out)


def signals(before: Sample, after: Sample, role: str) -> dict[str, float]:
    """The pool's signals between two reads (NaN where nothing was observed)."""

    def delta(name: str) -> float:
        key = f"{name}{{{role}}}"
        return after.values.get(key, 0.0) - before.values.get(key, 0.0)

    def mean(family: str) -> float:
        count = delta(f"{family}_count")
        return delta(f"{family}_sum") / count if count > 0 else math.nan

    return {
        "queue": mean("semcache_pool_queue_time_seconds"),
        "depth": after.values.get(f"semcache_pool_queue_depth{{{role}}}", math.nan),
        "kv": after.values.get(f"semcache_pool_kv_cache_usage{{{role}}}", math.nan),
        "ttft": mean("semcache_pool_ttft_seconds"),
        "running": after.values.get(f"{RUNNING}{{{role}}}", math.nan),
        "inflight": after.values.get(f"semcache_pool_inflight{{{role}}}", math.nan),
    }


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)
    requests: int = 0
    failed: int = 0

    def table(self) -> dict[str, dict[str, tuple[float, float]]]:
        """pool → signal → (mean, max) over the phase's intervals (NaN intervals left out;
        a queue or TTFT interval with no request observed counts as 0 in the mean)."""
        out: dict[str, dict[str, tuple[float, float]]] = {}
        for role in POOLS:
            series: dict[str, list[float]] = defaultdict(list)
            for before, after in zip(self.samples, self.samples[1:], strict=False):
                for name, value in signals(before, after, role).items():
                    if math.isnan(value) and name in ("queue", "ttft"):
                        value = 0.0
                    if not math.isnan(value):
                        series[name].append(value)
            out[role] = {
                name: (sum(v) / len(v), max(v)) if v else (math.nan, math.nan)
                for name in SIGNALS
                for v in [series[name]]
            }
        return out


def prompt(tokens: int, rng: random.Random) -> str:
    """~``tokens`` tokens of words that start with a unique number (no prefix shared)."""
    head = f"{rng.getrandbits(64)} {time.monotonic_ns()}: "
    return head + " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 12)))


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> bool:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"cf-aig-skip-cache": "true", "authorization": "Bearer bench"}
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code == 200
    except httpx.HTTPError:
        return False


async def burst(
    url: str, phase: Phase, seconds: float, concurrency: int, tokens: int, max_tokens: int
) -> None:
    """``concurrency`` closed loops of requests until ``seconds`` are over."""
    rng = random.Random(phase.name)
    deadline = time.monotonic() + seconds

    async def loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            ok = await one(client, url, prompt(tokens, rng), max_tokens)
            phase.requests += 1
            phase.failed += not ok

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))


async def sampler(url: str, phase_of: list[Phase], every: float, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                text = (await client.get(f"{url}/metrics")).text
                phase_of[0].samples.append(Sample(time.monotonic(), read(text)))
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass


async def run(args: argparse.Namespace, url: str) -> list[Phase]:
    phases = [Phase("quiet"), Phase("long prompts"), Phase("quiet again"), Phase("long answers")]
    current = [phases[0]]
    stop = asyncio.Event()
    reader = asyncio.create_task(sampler(url, current, args.every, stop))
    for phase in phases:
        current[0] = phase
        say(f"phase: {phase.name} ({args.seconds:.0f} s)")
        if phase.name == "long prompts":
            tokens, answer = args.prompt_tokens, args.prompt_answer_tokens
            await burst(url, phase, args.seconds, args.concurrency, tokens, answer)
        elif phase.name == "long answers":
            await burst(url, phase, args.seconds, args.concurrency, 16, args.answer_tokens)
        else:
            await asyncio.sleep(args.seconds)
        # the reads after a burst's end still describe it (vLLM's gauges, one health check late)
        await asyncio.sleep(args.every * 2)
    stop.set()
    await reader
    return phases


def report(phases: list[Phase]) -> None:
    tables = {p.name: p.table() for p in phases}
    print(f"{'phase':<14}{'pool':<9}" + "".join(f"{s:>18}" for s in SIGNALS) + "   requests")
    print(f"{'':<23}" + "".join(f"{'mean / max':>18}" for _ in SIGNALS))
    for phase in phases:
        for role in POOLS:
            row = tables[phase.name][role]
            cells = "".join(f"{row[s][0]:>9.3f} /{row[s][1]:>7.3f}" for s in SIGNALS)
            done = f"   {phase.requests} ({phase.failed} failed)" if role == "prefill" else ""
            print(f"{phase.name:<14}{role:<9}{cells}{done}")
    own = {"prefill": "long prompts", "decode": "long answers"}
    other = {"prefill": "long answers", "decode": "long prompts"}
    for role, signal in HPA_SIGNAL.items():
        mine = tables[own[role]][role][signal][0]
        theirs = tables[other[role]][role][signal][0]
        ratio = mine / theirs if theirs > 0 else math.inf
        print(
            f"{role} HPA signal ({signal}): mean {mine:.3f} under {own[role]}, "
            f"{theirs:.3f} under {other[role]}: {ratio:.1f}x"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--prompt-answer-tokens", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=512)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between two reads")
    ap.add_argument("--health-interval", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="scaling-signals-") as tmp:
        config = write_config(Path(tmp), args.health_interval)
        say("starting semcache serve (the embedded default: SmolLM2 1P1D)")
        gateway = GatewayProcess(config, launch=True).start(timeout_s=900)
        try:
            phases = asyncio.run(run(args, gateway.url))
        finally:
            gateway.stop()
    report(phases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
