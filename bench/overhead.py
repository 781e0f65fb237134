"""Gateway overhead: one chat workload sent straight to vLLM and through the gateway.

Claim checked (issue 2): the gateway adds at most 2 ms to TTFT p50 and loses no throughput.

A real vLLM server (the tiny test Llama by default) and the real gateway (``python -m
server.cli serve --no-launch``: uvicorn in its own process, so the client's load does not
share its GIL) are started here. Four cells are measured (non-stream and stream, 1 and 8
concurrent requests), each for both targets; batches alternate direct/gateway, and the
order flips every round, so drift on this shared machine hits both alike. Two sustained
cells follow (non-stream and stream, 64 requests kept in flight for 10 s windows, vLLM's
batch capped at 32 so it always has a full batch and a queue): there tok/s is vLLM's
capacity as each target delivers it, and that is where "loses no throughput" is judged.
They sample vLLM's running and waiting requests during every window (the gateway must never
leave vLLM's queue empty), and with ``--control`` add a third target: direct traffic while
``diagnostics/cpu_burn.py`` burns, on the client's core, the CPU share the gateway used (does the
gateway's CPU alone, on the core next to vLLM's, cost vLLM throughput?).
With 1 or 8 requests sent together and awaited, tok/s is tokens over latency: those ratios
restate the added latency and are shown, not judged. Every prompt is
unique (no prefix-cache help for whichever target comes second) and has the same length;
``max_tokens`` is fixed with ``ignore_eos`` and temperature 0, so every answer has the same
number of tokens.

TTFT: time to the first SSE event carrying content (stream) or the whole answer
(non-stream). tokens/s: completion tokens (from ``usage``) / wall time of the batches.
CPU ms/req: CPU time of this client, and of the gateway process net of what it burns idle
(a figure that, unlike latency, does not depend much on what else the machine is doing).

vLLM (all its processes) is pinned to core 1 by default; the gateway and this client share
the other core(s). The client is aiohttp by default: it shares a core with the gateway, so its
own CPU delays the gateway (a gateway can forward a request only once it gets the core), and
httpx (``--client httpx``, what the openai SDK uses) costs about 3x more per request and 4x
more per streamed chunk; with it, 8 concurrent requests measured a few ms worse for any proxy.
Exit status: 0 when every target is met, 1 when not, 130 on Ctrl-C.

    .venv/bin/python bench/overhead.py --quick              # smoke check, < 2 min + vLLM start
    .venv/bin/python bench/overhead.py [--requests 64] [--max-tokens 64]
    .venv/bin/python bench/overhead.py --model-path prepared:smollm2-135m-instruct
    .venv/bin/python bench/overhead.py --vllm-url http://127.0.0.1:8100   # a running vLLM
    .venv/bin/python bench/overhead.py --client httpx          # the earlier, heavier client
    .venv/bin/python bench/overhead.py --minimal-proxy         # the floor: a bare aiohttp proxy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson
import psutil

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.config import VllmLaunch, VllmServer
from backends.launch.process import VllmProcess
from backends.models import prepare_model
from backends.scraped_metrics import parse_upstream_metrics
from bench.support import (
    GATEWAY_MODEL_ID,
    affinity,
    bootstrap_interval,
    exit_status,
    gateway_process,
    gateway_toml,
    parse_cores,
    pct,
    served_model_of,
    stderr_printer,
)
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir, tiny_llama
from server.config import load_config

REPO = Path(__file__).resolve().parent.parent
CPU_BURN = REPO / "bench" / "diagnostics" / "cpu_burn.py"
MINIMAL_PROXY = REPO / "bench" / "diagnostics" / "minimal_proxy.py"
TTFT_TARGET_MS = 2.0
JSON_HEADERS = {"content-type": "application/json"}
PROMPT = (
    "Write a short story about a cat who finds a map near the old tree, follows the river "
    "to a small house, and reads a letter from a friend in Paris. Keep it simple."
)
FIRST_CONTENT = re.compile(rb'"content":"[^"]')
"""An SSE event whose delta carries text (vLLM's first, role-only event has ``""``)."""


say = stderr_printer("overhead")


# -- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    stream: bool
    concurrency: int

    @property
    def label(self) -> str:
        return f"{'stream' if self.stream else 'non-stream'} c={self.concurrency}"


CELLS = (Cell(False, 1), Cell(True, 1), Cell(False, 8), Cell(True, 8))
VLLM_MAX_NUM_SEQS = 32
"""vLLM's batch limit here (``--max-num-seqs``, when vLLM is started by this script)."""
SUSTAINED_IN_FLIGHT = 64
"""Requests kept in flight by the sustained cells: twice vLLM's batch, so vLLM always has a
full batch and a queue, and tok/s is its capacity as each target delivers it (below that,
tok/s at a fixed number in flight is still tokens over latency). 64 is also the gateway's
default per-server limit (``max_inflight_per_server``), so the gateway queues nothing."""
SUSTAINED = (Cell(False, SUSTAINED_IN_FLIGHT), Cell(True, SUSTAINED_IN_FLIGHT))


@dataclass(frozen=True)
class Target:
    """One place the workload goes: vLLM itself, or the gateway in front of it."""

    name: str
    url: str
    model: str
    client: httpx.AsyncClient | aiohttp.ClientSession
    server_pid: int | None = None
    """The gateway's process, whose CPU time per request is measured (None for vLLM)."""
    server_idle_cpu: float = 0.0
    """CPU seconds per second the server burns with no traffic (background tasks)."""


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    total_s: float
    completion_tokens: int


@dataclass
class Batch:
    """Requests measured together (sent at once, or kept in flight for a while); throughput
    is measured over their wall time."""

    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    vllm_queue: list[tuple[float, float]] = field(default_factory=list)
    """(running, waiting) requests in vLLM, sampled during a sustained window."""

    @property
    def tokens(self) -> int:
        return sum(s.completion_tokens for s in self.samples)

    def add(self, sample: Sample, max_tokens: int) -> None:
        self.samples.append(sample)
        if sample.completion_tokens != max_tokens:
            self.errors.append(f"{sample.completion_tokens} tokens, not {max_tokens}")


class RequestFailed(Exception):
    """A request got no complete, well-formed answer."""


def chat_body(model: str, uid: int, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        # The number first, zero-padded: unique prompts of one length, no shared prefix.
        "messages": [{"role": "user", "content": f"{uid:07d}. {PROMPT}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def stream_usage(raw: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of the last SSE event carrying one."""
    for event in reversed(raw.split(b"\n\n")):
        payload = event.strip().removeprefix(b"data:").strip()
        if b'"usage"' not in payload:
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            usage = orjson.loads(payload).get("usage")
            if isinstance(usage, dict):
                return usage
    return None


async def one_request(target: Target, body: bytes, stream: bool) -> Sample:
    if isinstance(target.client, aiohttp.ClientSession):
        return await _one_request_aiohttp(target.client, target.url, body, stream)
    return await _one_request_httpx(target.client, target.url, body, stream)


class _StreamScan:
    """A streamed answer as it arrives: its bytes, and when the first content event came."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.raw = bytearray()
        self.ttft: float | None = None

    def feed(self, chunk: bytes) -> None:
        now = time.perf_counter()
        scan_from = max(0, len(self.raw) - 16)
        self.raw += chunk
        if self.ttft is None and FIRST_CONTENT.search(self.raw, scan_from):
            self.ttft = now - self.started

    def sample(self) -> Sample:
        raw = self.raw
        if not raw.rstrip().endswith(b"data: [DONE]"):
            raise RequestFailed(f"stream ended without [DONE]: ...{bytes(raw[-200:])!r}")
        usage = stream_usage(bytes(raw))
        if self.ttft is None or usage is None:
            raise RequestFailed("stream without content or without usage")
        total = time.perf_counter() - self.started
        return Sample(self.ttft, total, int(usage.get("completion_tokens", 0)))


def _json_sample(content: bytes, started: float) -> Sample:
    """A whole JSON answer: its time to the last byte counts as TTFT too."""
    total = time.perf_counter() - started
    usage = orjson.loads(content).get("usage") or {}
    return Sample(total, total, int(usage.get("completion_tokens", 0)))


async def _one_request_aiohttp(
    client: aiohttp.ClientSession, base: str, body: bytes, stream: bool
) -> Sample:
    started = time.perf_counter()
    async with client.post(f"{base}/v1/chat/completions", data=body, headers=JSON_HEADERS) as r:
        content = await r.read() if not stream or r.status != 200 else b""
        if r.status != 200:
            raise RequestFailed(f"HTTP {r.status}: {content[:200]!r}")
        if not stream:
            return _json_sample(content, started)
        scan = _StreamScan(started)
        async for chunk in r.content.iter_any():
            scan.feed(chunk)
    return scan.sample()


async def _one_request_httpx(
    client: httpx.AsyncClient, base: str, body: bytes, stream: bool
) -> Sample:
    url = f"{base}/v1/chat/completions"
    started = time.perf_counter()
    if not stream:
        response = await client.post(url, content=body, headers=JSON_HEADERS)
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        return _json_sample(response.content, started)
    scan = _StreamScan(started)
    async with client.stream("POST", url, content=body, headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            await response.aread()
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        async for chunk in response.aiter_raw():
            scan.feed(chunk)
    return scan.sample()


def cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return float(times.user + times.system)


async def idle_cpu(pid: int, seconds: float) -> float:
    """CPU seconds per second that process ``pid`` uses while nothing is sent to it."""
    process = psutil.Process(pid)
    cpu, started = cpu_seconds(process), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(process) - cpu) / (time.perf_counter() - started)


class Meter:
    """Wall time, this client's CPU and the gateway's (net of what it burns idle) from now."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.server = psutil.Process(target.server_pid) if target.server_pid else None
        self.server_cpu = cpu_seconds(self.server)
        self.client_cpu = time.process_time()
        self.started = time.perf_counter()

    def stop(self, batch: Batch) -> Batch:
        batch.wall_s = time.perf_counter() - self.started
        batch.client_cpu_s = time.process_time() - self.client_cpu
        idle = self.target.server_idle_cpu * batch.wall_s
        batch.server_cpu_s = cpu_seconds(self.server) - self.server_cpu - idle
        return batch


async def run_batch(target: Target, cell: Cell, uids: Iterator[int], max_tokens: int) -> Batch:
    bodies = [
        chat_body(target.model, next(uids), max_tokens, cell.stream)
        for _ in range(cell.concurrency)
    ]
    meter = Meter(target)
    results = await asyncio.gather(
        *(one_request(target, body, cell.stream) for body in bodies), return_exceptions=True
    )
    batch = meter.stop(Batch())
    for result in results:
        if isinstance(result, Sample):
            batch.add(result, max_tokens)
        elif isinstance(result, Exception):
            batch.errors.append(f"{type(result).__name__}: {result}")
        else:
            raise result
    return batch


async def run_sustained(
    target: Target,
    cell: Cell,
    uids: Iterator[int],
    max_tokens: int,
    seconds: float,
    *,
    vllm_url: str | None = None,
    burn_fraction: float | None = None,
) -> Batch:
    """``cell.concurrency`` requests kept in flight for ``seconds`` (each worker sends its next
    request as soon as its last one ends); the wall time runs until the last one ends.

    ``vllm_url``: sample vLLM's running and waiting requests while the window is full.
    ``burn_fraction``: burn that share of this process's core(s) meanwhile
    (``diagnostics/cpu_burn.py``).
    """
    batch = Batch()
    burner = (
        await asyncio.create_subprocess_exec(sys.executable, str(CPU_BURN), str(burn_fraction))
        if burn_fraction is not None
        else None
    )
    try:
        meter = Meter(target)
        deadline = meter.started + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                body = chat_body(target.model, next(uids), max_tokens, cell.stream)
                try:
                    batch.add(await one_request(target, body, cell.stream), max_tokens)
                except Exception as exc:  # counted; the worker stops (no error storm)
                    batch.errors.append(f"{type(exc).__name__}: {exc}")
                    return

        sampler = (
            asyncio.create_task(sample_vllm_queue(vllm_url, meter.started + 1.0, deadline, batch))
            if vllm_url
            else None
        )
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
        if sampler is not None:
            await sampler
        return meter.stop(batch)
    finally:
        if burner is not None:
            burner.kill()
            await burner.wait()


async def sample_vllm_queue(url: str, start: float, end: float, batch: Batch) -> None:
    """vLLM's running and waiting requests every 0.25 s from ``start`` to ``end``."""
    wanted = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 1}
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        while time.perf_counter() < end:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{url}/metrics") as response:
                    gauges = [0.0, 0.0]
                    for sample in parse_upstream_metrics(await response.text()):
                        if sample.name in wanted:
                            gauges[wanted[sample.name]] += sample.value
                    batch.vllm_queue.append((gauges[0], gauges[1]))
            await asyncio.sleep(0.25)


Results = dict[tuple[Cell, str], list[Batch]]


async def run_workload(
    targets: tuple[Target, Target], requests: int, warmup: int, max_tokens: int
) -> Results:
    """Every cell, ``requests`` requests per target, in rounds of alternating batches."""
    uids = iter(range(10**7))
    plan = {cell: max(1, -(-requests // cell.concurrency)) for cell in CELLS}
    results: Results = {(cell, t.name): [] for cell in CELLS for t in targets}
    rounds = max(plan.values())
    for rnd in range(-warmup, rounds):
        order = targets if rnd % 2 == 0 else targets[::-1]
        for cell in CELLS:
            if rnd >= plan[cell]:
                continue
            for target in order:
                batch = await run_batch(target, cell, uids, max_tokens)
                if rnd >= 0:
                    results[cell, target.name].append(batch)
                elif batch.errors:
                    raise RequestFailed(f"warm-up to {target.name} failed: {batch.errors[0]}")
        if rnd >= 0 and (rnd + 1) % max(1, rounds // 4) == 0:
            say(f"round {rnd + 1}/{rounds}")
    return results


CONTROL = "direct+gw CPU"
"""The sustained cells' control: direct traffic while ``diagnostics/cpu_burn.py`` burns, on
the client's core, the share of it the gateway used in its last window of the cell."""


async def run_sustained_workload(
    targets: tuple[Target, Target],
    rounds: int,
    seconds: float,
    max_tokens: int,
    vllm_url: str,
    control: bool,
) -> Results:
    """The sustained cells: ``rounds`` windows of ``seconds`` per target, alternating (with
    the control, the gateway always in the middle: the control burns what the gateway used
    in its window just before, or in the round before)."""
    direct, gateway = targets
    uids = iter(range(10**7, 2 * 10**7))
    names = [direct.name, gateway.name] + ([CONTROL] if control else [])
    results: Results = {(cell, name): [] for cell in SUSTAINED for name in names}
    gateway_share = dict.fromkeys(SUSTAINED, 0.0)
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for cell in SUSTAINED:
            for name in order:
                target = gateway if name == gateway.name else direct
                burn = gateway_share[cell] if name == CONTROL else None
                batch = await run_sustained(
                    target, cell, uids, max_tokens, seconds, vllm_url=vllm_url, burn_fraction=burn
                )
                if name == gateway.name:
                    gateway_share[cell] = max(0.0, batch.server_cpu_s / batch.wall_s)
                results[cell, name].append(batch)
        say(f"sustained round {rnd + 1}/{rounds}")
    return results


# -- statistics and the table ---------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    ttft_ms: np.ndarray
    total_ms: np.ndarray
    batch_tokens: np.ndarray
    batch_wall_s: np.ndarray
    client_cpu_ms: float
    """CPU time of this load client per request."""
    server_cpu_ms: float
    """CPU time of the gateway process per request (0 for direct)."""
    errors: int

    @classmethod
    def of(cls, batches: Sequence[Batch]) -> Summary:
        samples = [s for b in batches for s in b.samples]
        return cls(
            ttft_ms=np.array([s.ttft_s * 1e3 for s in samples]),
            total_ms=np.array([s.total_s * 1e3 for s in samples]),
            batch_tokens=np.array([b.tokens for b in batches], dtype=float),
            batch_wall_s=np.array([b.wall_s for b in batches]),
            client_cpu_ms=1e3 * sum(b.client_cpu_s for b in batches) / max(1, len(samples)),
            server_cpu_ms=1e3 * sum(b.server_cpu_s for b in batches) / max(1, len(samples)),
            errors=sum(len(b.errors) for b in batches),
        )

    @property
    def tokens_per_s(self) -> float:
        return float(self.batch_tokens.sum() / self.batch_wall_s.sum())


def bootstrap(a: Summary, b: Summary) -> tuple[tuple[float, float], tuple[float, float]]:
    """95 % intervals of ``b``'s TTFT p50 minus ``a``'s and of ``b``'s throughput over ``a``'s.

    TTFT samples are resampled per target; batches are resampled in pairs (round i of ``a``
    with round i of ``b``), since a round's two batches share the same drift.
    """

    def ttft_p50_difference(rng: np.random.Generator) -> float:
        resampled = [rng.choice(s.ttft_ms, s.ttft_ms.size) for s in (a, b)]
        return float(np.median(resampled[1]) - np.median(resampled[0]))

    rounds = min(a.batch_wall_s.size, b.batch_wall_s.size)

    def throughput_ratio(rng: np.random.Generator) -> float:
        idx = rng.integers(0, rounds, rounds)
        a_tps = a.batch_tokens[idx].sum() / a.batch_wall_s[idx].sum()
        return float(b.batch_tokens[idx].sum() / b.batch_wall_s[idx].sum() / a_tps)

    return bootstrap_interval(ttft_p50_difference), bootstrap_interval(throughput_ratio)


def report(results: Results, tolerance: float) -> bool:
    """Print the comparison table and the verdicts; True when every target is met."""
    head = f"{'cell':<16}{'target':<18}"
    cols = ("TTFT p50", "TTFT p99", "total p50", "total p99")
    head += "".join(f"{c:>11}" for c in cols) + f"{'tok/s':>10}{'cli CPU':>9}{'gw CPU':>9}"
    print(head + f"{'n':>6}{'errors':>8}")
    print(
        f"{'':<34}" + "".join(f"{'ms':>11}" for _ in cols) + f"{'':>10}{'ms/req':>9}{'ms/req':>9}"
    )
    verdicts: list[str] = []
    all_met = True
    cells = [cell for cell in (*CELLS, *SUSTAINED) if (cell, "direct") in results]
    for cell in cells:
        sustained = cell in SUSTAINED
        direct = Summary.of(results[cell, "direct"])
        gateway = Summary.of(results[cell, "gateway"])
        control = Summary.of(results[cell, CONTROL]) if (cell, CONTROL) in results else None
        rows = [("direct", direct), ("gateway", gateway)]
        rows += [(CONTROL, control)] if control is not None else []
        for name, s in rows:
            row = (pct(s.ttft_ms, 50), pct(s.ttft_ms, 99), pct(s.total_ms, 50), pct(s.total_ms, 99))
            label = f"{cell.label}{' sus' if sustained else ''}"
            print(
                f"{label if name == 'direct' else '':<16}{name:<18}"
                + "".join(f"{v:11.2f}" for v in row)
                + f"{s.tokens_per_s:10.1f}{s.client_cpu_ms:9.2f}{s.server_cpu_ms:9.2f}"
                + f"{s.ttft_ms.size:6d}{s.errors:8d}"
            )
        diffs = [pct(gateway.ttft_ms, p) - pct(direct.ttft_ms, p) for p in (50, 99)] + [
            pct(gateway.total_ms, p) - pct(direct.total_ms, p) for p in (50, 99)
        ]
        ratio = gateway.tokens_per_s / direct.tokens_per_s
        print(
            f"{'':<16}{'gateway - direct':<18}"
            + "".join(f"{v:+11.2f}" for v in diffs)
            + f"{ratio:9.3f}x"
        )
        ttft_ci, ratio_ci = bootstrap(direct, gateway)
        clean = all(s.errors == 0 for _, s in rows)
        errors = "" if clean else "; ERRORS (see table)"
        all_met &= clean
        tput = f"tok/s ratio {ratio:.3f} [{ratio_ci[0]:.3f}, {ratio_ci[1]:.3f}]"
        if sustained:  # throughput is judged here, where it is vLLM's capacity
            tput_ok = ratio >= 1.0 - tolerance
            all_met &= tput_ok
            verdicts.append(
                f"  {cell.label + ' sustained':<24} gateway/direct {tput} "
                f"{'met' if tput_ok else 'NOT MET'}" + errors
            )
            if control is not None:
                own = control.tokens_per_s / direct.tokens_per_s
                _, own_ci = bootstrap(direct, control)
                rest = gateway.tokens_per_s / control.tokens_per_s
                _, rest_ci = bootstrap(control, gateway)
                verdicts.append(
                    f"  {'':<24} control: {CONTROL}/direct {own:.3f} [{own_ci[0]:.3f}, "
                    f"{own_ci[1]:.3f}] (the gateway's CPU share burnt, no gateway); "
                    f"gateway/({CONTROL}) {rest:.3f} [{rest_ci[0]:.3f}, {rest_ci[1]:.3f}]"
                )
            verdicts.append(f"  {'':<24} {queue_note(results, cell)}")
            verdicts.append(f"  {'':<24} {window_note(rows)}")
            continue
        ttft_ok = diffs[0] <= TTFT_TARGET_MS
        all_met &= ttft_ok
        verdicts.append(
            f"  {cell.label:<15} TTFT p50 {diffs[0]:+6.2f} ms "
            f"[95% CI {ttft_ci[0]:+.2f}, {ttft_ci[1]:+.2f}] {'met' if ttft_ok else 'NOT MET'}; "
            f"{tput} (latency-bound: = direct/gateway total latency)" + errors
        )
    print()
    print(
        f"Targets (issue 2): the gateway adds <= {TTFT_TARGET_MS:g} ms to TTFT p50; it loses "
        f"no throughput: with {SUSTAINED_IN_FLIGHT} requests kept in flight (vLLM's batch of "
        f"{VLLM_MAX_NUM_SEQS} full, the rest queued), gateway/direct tok/s >= "
        f"{1 - tolerance:.2f} ({tolerance:.0%} measurement tolerance). With 1 or 8 requests "
        "sent together and awaited, tok/s is tokens over latency, so those ratios restate "
        "the latency the gateway adds (e.g. 1.5 ms over a 107 ms answer: 0.986) and are "
        "shown, not judged."
    )
    print("\n".join(verdicts))
    print(f"Overall: {'all targets met' if all_met else 'NOT all targets met'}")
    return all_met


def queue_note(results: Results, cell: Cell) -> str:
    """vLLM's running and waiting requests during each target's full windows."""
    parts = []
    for name in ("direct", "gateway", CONTROL):
        samples = [q for b in results.get((cell, name), []) for q in b.vllm_queue]
        if samples:
            running, waiting = np.array(samples).T
            parts.append(
                f"{name} running min {running.min():.0f}, waiting min {waiting.min():.0f} "
                f"(median {np.median(waiting):.0f})"
            )
    samples_note = "; ".join(parts) if parts else "not sampled"
    return f"vLLM's queue while the window was full (every 0.25 s): {samples_note}"


def window_note(rows: list[tuple[str, Summary]]) -> str:
    """How much one target's tok/s moves from window to window: the noise any ratio
    between targets has to beat."""
    parts = []
    for name, summary in rows:
        tps = summary.batch_tokens / summary.batch_wall_s
        if tps.size > 1:
            spread = tps.std(ddof=1) / tps.mean()
            parts.append(f"{name} {tps.min():.0f}-{tps.max():.0f} (sd {spread:.1%})")
    return "tok/s of single windows: " + "; ".join(parts) if parts else "one window per target"


def first_errors(results: Results, limit: int = 5) -> list[str]:
    errors = [f"{c.label} {t}: {e}" for (c, t), bs in results.items() for b in bs for e in b.errors]
    return errors[:limit]


# -- processes ------------------------------------------------------------------------


# -- main -----------------------------------------------------------------------------


def load_client(kind: str) -> httpx.AsyncClient | aiohttp.ClientSession:
    """The load client's HTTP client: aiohttp (light) or httpx (what the openai SDK uses)."""
    if kind == "httpx":
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=10.0))
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=600.0, sock_connect=10.0),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def run(args: argparse.Namespace, vllm_cores: set[int] | None) -> bool:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (&)
        loop.add_signal_handler(sig, task.cancel)
    data_dir: Path = args.data_dir
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="semcache-overhead-")))
        model_path: Path | None = None
        vllm: VllmProcess | None = None
        if args.vllm_url:
            vllm_url = args.vllm_url.rstrip("/")
            served = args.served_model or await served_model_of(vllm_url)
            vllm_note = f"vLLM: {served} at {vllm_url} (already running)"
        else:
            if args.model_path:
                model_path = await asyncio.to_thread(prepare_model, args.model_path, data_dir, say)
                served = args.served_model or model_path.name
            else:
                model_path = await tiny_llama(data_dir)
                served = TINY_MODEL_NAME
            vllm_url = f"http://127.0.0.1:{free_port()}"

            async def start_vllm(extra_args: list[str]) -> VllmProcess:
                launch = VllmLaunch(
                    cpu_cores=args.vllm_cores if vllm_cores else None,
                    kv_cache_gib=1.0,
                    max_model_len=args.max_model_len,
                    extra_args=extra_args,
                )
                process = VllmProcess(
                    model=model_path,
                    served_model=served,
                    server=VllmServer(url=vllm_url, launch=launch),
                    data_dir=data_dir,
                    log_name=f"overhead-{served}",
                )
                say(f"starting vLLM ({served}) at {vllm_url}; log {process.log_path}")
                with affinity(vllm_cores):  # every vLLM process inherits the pinning
                    process.start()
                stack.push_async_callback(process.stop)
                waited = await process.wait_ready(600.0, say)
                say(f"vLLM ready after {waited:.0f} s")
                return process

            vllm = await start_vllm([])
            pin = f", all its processes pinned to core(s) {args.vllm_cores}" if vllm_cores else ""
            vllm_note = f"vLLM: {served} at {vllm_url} (started here{pin})"

        port = free_port()
        config_path = tmp / "gateway.toml"
        config_path.write_text(
            gateway_toml(
                data_dir=tmp,  # the gateway's disk cache is thrown away afterwards
                port=port,
                vllm_url=vllm_url,
                served=served,
                model=model_path,
                cache=args.cache,
            )
        )
        load_config(config_path)  # fail here, not in the child, on a bad config
        gateway = gateway_process(config_path, port, tmp / "gateway.log")
        if args.minimal_proxy:
            gateway.command = [sys.executable, str(MINIMAL_PROXY), str(port), vllm_url, served]
        gateway.start()
        stack.push_async_callback(gateway.stop)
        await gateway.wait_ready(180.0)
        say(f"gateway ready at {gateway.url} (pid {gateway.pid})")

        clients = [load_client(args.client) for _ in range(2)]
        for client in clients:
            stack.push_async_callback(
                client.close if isinstance(client, aiohttp.ClientSession) else client.aclose
            )
        gateway_idle = await idle_cpu(gateway.pid, 3.0 if args.quick else 10.0)
        targets = (
            Target("direct", vllm_url, served, clients[0]),
            Target("gateway", gateway.url, GATEWAY_MODEL_ID, clients[1], gateway.pid, gateway_idle),
        )
        load_before = os.getloadavg()[0]
        say(f"measuring: {args.requests} requests per cell and target, {args.warmup} warm-up")
        started = time.monotonic()
        results = await run_workload(targets, args.requests, args.warmup, args.max_tokens)
        if args.sustained_rounds > 0:
            if vllm is not None:
                # vLLM again, its batch capped (a cap changes its step timing, so the cells
                # above run on vLLM's defaults); the gateway re-admits it once it answers.
                await vllm.stop()
                vllm = await start_vllm(["--max-num-seqs", str(VLLM_MAX_NUM_SEQS)])
                await gateway.wait_ready(180.0)
                for target in targets:  # pooled connections to the old vLLM fail once
                    for _ in range(2):
                        with contextlib.suppress(Exception):
                            await one_request(target, chat_body(target.model, 0, 4, False), False)
            say(
                f"sustained load: {SUSTAINED_IN_FLIGHT} in flight, {args.sustained_rounds} "
                f"rounds of {args.sustained_seconds:g} s per cell and target"
            )
            results |= await run_sustained_workload(
                targets,
                args.sustained_rounds,
                args.sustained_seconds,
                args.max_tokens,
                vllm_url,
                control=args.control,
            )
        elapsed = time.monotonic() - started

    client_cores = sorted(os.sched_getaffinity(0))
    print()
    print(vllm_note)
    if args.minimal_proxy:
        print(
            f"gateway: {gateway.url}, bench/diagnostics/minimal_proxy.py in its place (own process)"
        )
    else:
        print(
            f"gateway: {gateway.url}, python -m server.cli serve --no-launch (uvicorn, own "
            f"process); answer cache {'on (every request a miss)' if args.cache else 'off'}"
        )
    print(
        f"gateway idle CPU (health checks, queue polling, ...): {1e3 * gateway_idle:.1f} ms/s; "
        "gw CPU below is net of it"
    )
    if vllm_cores:
        print(
            f"CPU: the gateway and this load client ({args.client}) share core(s) "
            f"{','.join(map(str, client_cores))}; vLLM has core(s) {args.vllm_cores}"
        )
    else:
        print(f"CPU: no pinning; {os.cpu_count()} cores, shared by vLLM, gateway and client")
    print(
        f"workload: chat, unique {len(PROMPT.split()) + 1}-word prompts, max_tokens="
        f"{args.max_tokens}, ignore_eos, temperature 0; {args.requests} requests per cell and "
        f"target; direct/gateway batches alternate (order flips each round); {elapsed:.0f} s"
    )
    print(
        f"machine load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
        f"(other work shares this machine)"
    )
    print()
    met = report(results, args.throughput_tolerance)
    for line in first_errors(results):
        print(f"error: {line}")
    return met


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="requests per cell and target")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per answer")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds (not measured)")
    ap.add_argument("--quick", action="store_true", help="a small run for a smoke check")
    ap.add_argument("--vllm-url", help="use this running vLLM server instead of starting one")
    ap.add_argument(
        "--model-path",
        help="model to serve (folder, or prepared:NAME, e.g. prepared:smollm2-135m-instruct); "
        "default: the tiny random-weight test Llama",
    )
    ap.add_argument("--served-model", help="vLLM's model name (default: the folder's name)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--data-dir",
        default=str(test_data_dir()),
        help="where models are built/prepared and vLLM logs go (default: the tests' data dir)",
    )
    ap.add_argument(
        "--vllm-cores",
        help="cores vLLM runs on (the one started here is pinned to them); the gateway and "
        "the client get the others. 'none': no pinning. Default: 1, or none with --vllm-url",
    )
    ap.add_argument(
        "--no-cache",
        dest="cache",
        action="store_false",
        help="turn the gateway's answer cache off (default: on, as configured by default; "
        "every prompt is unique, so each request pays a cache miss)",
    )
    ap.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the load client's HTTP library (default aiohttp: ~5x less CPU per request than "
        "httpx, which shares a core with the gateway)",
    )
    ap.add_argument(
        "--minimal-proxy",
        action="store_true",
        help="measure bench/diagnostics/minimal_proxy.py (aiohttp in and out, nothing else) in the "
        "gateway's place: the floor of any Python proxy in this layout",
    )
    ap.add_argument("--throughput-tolerance", type=float, default=0.01)
    ap.add_argument(
        "--sustained-rounds",
        type=int,
        default=None,
        help=f"rounds of the sustained cells ({SUSTAINED_IN_FLIGHT} requests kept in flight), "
        "where throughput is judged; 0 skips them (default 6, 1 with --quick)",
    )
    ap.add_argument(
        "--sustained-seconds",
        type=float,
        default=None,
        help="length of one sustained window per target (default 10 s, 3 s with --quick)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help=f"add a control target to the sustained cells ({CONTROL!r}: direct traffic while "
        f"{CPU_BURN.relative_to(REPO)} burns, on the client's core, the CPU share the gateway "
        "used)",
    )
    return ap


def pinning(args: argparse.Namespace) -> set[int] | None:
    """vLLM's cores, or None when nothing is pinned; pins this process to the rest."""
    if args.vllm_cores is None:
        args.vllm_cores = "none" if args.vllm_url else "1"
    if args.vllm_cores.lower() == "none":
        return None
    available = os.sched_getaffinity(0)
    cores = parse_cores(args.vllm_cores)
    rest = available - cores
    if not cores <= available or not rest:
        say(f"not pinning: cores {args.vllm_cores} leave nothing else of {sorted(available)}")
        return None
    os.sched_setaffinity(0, rest)  # before any thread exists, so all of them inherit it
    return cores


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.data_dir = Path(args.data_dir).resolve()
    if args.quick:
        args.requests, args.max_tokens, args.warmup = 16, 16, 1
    if args.sustained_rounds is None:
        args.sustained_rounds = 1 if args.quick else 6
    if args.sustained_seconds is None:
        args.sustained_seconds = 3.0 if args.quick else 10.0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm_cores = pinning(args)
    return exit_status(run(args, vllm_cores), say)


if __name__ == "__main__":
    raise SystemExit(main())
