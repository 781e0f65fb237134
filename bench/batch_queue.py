"""Batch queue vs live traffic: sync TTFT with and without a batch backlog, and batch items/s.

Claim checked (issue 6): with a large batch queued, the p50 time to first token of
synchronous Workers-AI streams stays within 20 % of its idle value, because batch workers
pull items only on idle capacity (sync first). For contrast the same backlog is run by
*greedy* workers (no yielding to live traffic, many items at once), as a push-based queue
would. Everything runs against a real vLLM (the tiny test model unless ``--vllm-url``) and
the real gateway as a subprocess (``python -m server.cli serve --no-launch``), with the
embedded SQLite queue.

Both gateways run side by side (each with its own queue) and take turns: a round is S sync
streams (one at a time) with nothing else running (idle); a batch of B items submitted; S
sync streams while it is queued and running (backlog); then the batch drains with no sync
traffic (alone). Alternating rounds between idle and backlogged phases, and between the two
modes, lets the machine's noise hit every figure alike. Batch items/s are shown while the
sync streams run and while the batch runs alone.

With ``--api openai`` the same rounds run on the OpenAI surface: the backlog is an OpenAI
batch (a JSONL file uploaded to ``/v1/files``, then ``POST /v1/batches``, done once the batch
is ``completed`` with its output file written) and the sync streams are
``/v1/chat/completions`` streams.

    .venv/bin/python bench/batch_queue.py [--vllm-url URL] [--rounds 10] [--backlog 40]
    .venv/bin/python bench/batch_queue.py --api openai --rounds 1 --backlog 1000 \
        --modes '{"pull (sync first)": {}}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import pct, toml_value
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir

MODEL = "@cf/meta/llama-3.1-8b-instruct"
TOKEN = "bench-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "cf-aig-skip-cache": "true"}

CLAIMED = "pull (sync first)"
MODES: dict[str, dict[str, Any]] = {
    "pull (sync first)": {},  # the gateway's defaults; the claim is checked on this one
    "pull, sync_idle_s 0.1": {"sync_idle_s": 0.1},
    "greedy (push-like)": {"yield_to_sync": False, "max_inflight": 16},
}


def write_config(work: Path, data_dir: Path, vllm_url: str, batch: dict[str, Any]) -> Path:
    lines = [
        f"data_dir = {toml_value(str(work))}",
        "[[models]]",
        'id = "tiny-chat"',
        'backend = "tiny"',
        f"aliases = {toml_value([MODEL])}",
        "[[backends]]",
        'kind = "vllm"',
        'name = "tiny"',
        f"served_model = {toml_value(TINY_MODEL_NAME)}",
        f"model_path = {toml_value(str(data_dir / 'models' / TINY_MODEL_NAME))}",
        "[[backends.servers]]",
        f"url = {toml_value(vllm_url)}",
    ]
    lines += ["[auth]", f"tokens = {toml_value([{'token': TOKEN, 'tenant': 'bench'}])}", "[batch]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in batch.items()]
    path = work / "gateway.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_url(base: str) -> str:
    return f"{base}/client/v4/accounts/bench/ai/run/{MODEL}"


API = "workers-ai"
"""The surface measured: ``workers-ai`` or ``openai`` (``--api``)."""


async def ttft(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> float:
    """Seconds to the first streamed piece of text of one live stream."""
    if API == "openai":
        return await openai_ttft(client, base, i, max_tokens)
    body = {"prompt": f"{uuid.uuid4().hex} question {i}", "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", run_url(base), headers=HEADERS, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith('data: {"response":"') and len(line) > 20:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("stream without text")
    return first


async def openai_ttft(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> float:
    """Seconds to the first streamed piece of text of one ``/v1/chat/completions`` stream."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} question {i}"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    async with client.stream(
        "POST", f"{base}/v1/chat/completions", headers=HEADERS, json=body
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("stream without text")
    return first


async def submit_openai(client: httpx.AsyncClient, base: str, n: int, max_tokens: int) -> str:
    """An OpenAI batch of ``n`` chat lines: the file uploaded, the batch created."""
    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} batch item {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0.7,
            },
        }
        for i in range(n)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    auth = {"Authorization": HEADERS["Authorization"]}
    r = await client.post(
        f"{base}/v1/files",
        headers=auth,
        files={"file": ("batch.jsonl", data)},
        data={"purpose": "batch"},
    )
    r.raise_for_status()
    body = {
        "input_file_id": r.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    r = await client.post(f"{base}/v1/batches", headers=auth, json=body)
    r.raise_for_status()
    if r.json()["status"] != "in_progress":
        raise RuntimeError(f"the batch was not queued: {r.json()}")
    return str(r.json()["id"])


async def sync_phase(
    client: httpx.AsyncClient, base: str, n: int, max_tokens: int, gap_s: float
) -> list[float]:
    out = []
    for i in range(n):
        out.append(await ttft(client, base, i, max_tokens))
        await asyncio.sleep(gap_s)
    return out


async def submit(client: httpx.AsyncClient, base: str, n: int, max_tokens: int) -> str:
    if API == "openai":
        return await submit_openai(client, base, n, max_tokens)
    requests = [
        {
            "prompt": f"{uuid.uuid4().hex} batch item {i}",
            "max_tokens": max_tokens,
            "temperature": 0.7,
        }
        for i in range(n)
    ]
    r = await client.post(
        run_url(base) + "?queueRequest=true", headers=HEADERS, json={"requests": requests}
    )
    r.raise_for_status()
    return str(r.json()["result"]["request_id"])


def completed(db: Path, request_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        (n,) = conn.execute(
            "SELECT count(*) FROM results WHERE job_id = ?", (request_id,)
        ).fetchone()
    return int(n)


async def wait_status(client: httpx.AsyncClient, base: str, rid: str, want: str) -> None:
    if API == "openai":
        await wait_openai(client, base, rid, want)
        return
    while True:
        r = await client.post(run_url(base), headers=HEADERS, json={"request_id": rid})
        result = r.json()["result"]
        status = "done" if "responses" in result else result["status"]
        if status == want or status == "done":
            return
        await asyncio.sleep(0.05)


async def wait_openai(client: httpx.AsyncClient, base: str, rid: str, want: str) -> None:
    """``running``: some line has started; ``done``: the batch is completed (output written)."""
    auth = {"Authorization": HEADERS["Authorization"]}
    while True:
        batch = (await client.get(f"{base}/v1/batches/{rid}", headers=auth)).json()
        if batch["status"] in ("failed", "expired", "cancelled"):
            raise RuntimeError(f"the batch ended {batch['status']}: {batch.get('errors')}")
        if batch["status"] == "completed":
            return
        if want == "running" and batch["request_counts"]["completed"] > 0:
            return
        await asyncio.sleep(0.05)


class Mode:
    """One gateway (a batch-scheduling mode) and the figures measured through it."""

    def __init__(
        self, name: str, overrides: dict[str, Any], work: Path, data_dir: Path, vllm_url: str
    ) -> None:
        self.name = name
        self.db = work / "queue.sqlite3"
        batch = {
            "queue": {"path": str(self.db), "lease_s": 10.0},
            "max_items": 100_000,
            **overrides,
        }
        self.gateway = GatewayProcess(write_config(work, data_dir, vllm_url, batch))
        self.idle: list[float] = []
        self.loaded: list[float] = []
        self.loaded_items = self.drain_items = 0
        self.loaded_s = self.drain_s = 0.0

    async def round(self, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
        """Idle syncs; a backlog submitted; syncs while it runs; the backlog drained alone."""
        base = self.gateway.url
        self.idle += await sync_phase(client, base, args.per_round, args.sync_tokens, args.gap)
        rid = await submit(client, base, args.backlog, args.batch_tokens)
        await wait_status(client, base, rid, "running")
        await asyncio.sleep(0.5)  # the workers reach their steady state
        done0, start = completed(self.db, rid), time.perf_counter()
        self.loaded += await sync_phase(client, base, args.per_round, args.sync_tokens, args.gap)
        done1, mid = completed(self.db, rid), time.perf_counter()
        if done1 >= args.backlog:
            print(
                f"  [{self.name}] the backlog ran out during the sync phase; raise --backlog",
                file=sys.stderr,
            )
        self.loaded_items += done1 - done0
        self.loaded_s += mid - start
        await wait_status(client, base, rid, "done")
        self.drain_items += args.backlog - done1
        self.drain_s += time.perf_counter() - mid


async def run_modes(args: argparse.Namespace, data_dir: Path, vllm_url: str) -> list[Mode]:
    """Both gateways up at once; rounds alternate between them so noise hits both alike."""
    with tempfile.TemporaryDirectory(prefix="semcache-bench-queue-") as tmp:
        modes = []
        for i, (name, overrides) in enumerate(args.modes.items()):
            work = Path(tmp) / str(i)
            work.mkdir()
            modes.append(Mode(name, overrides, work, data_dir, vllm_url))
        try:
            for mode in modes:
                mode.gateway.start()
            async with httpx.AsyncClient(timeout=600) as client:
                for mode in modes:
                    await sync_phase(
                        client, mode.gateway.url, 5, args.sync_tokens, args.gap
                    )  # warm up
                for _ in range(args.rounds):
                    for mode in modes:
                        await mode.round(client, args)
        finally:
            for mode in modes:
                mode.gateway.kill()  # the backlog is thrown away with the directory
    return modes


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm-url",
        default=os.environ.get("SEMCACHE_TEST_VLLM_URL"),
        help="a running vLLM serving the tiny test model (default: start one)",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=6, help="sync streams per phase")
    parser.add_argument("--sync-tokens", type=int, default=16)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.3,
        help="seconds between sync streams (live traffic that never leaves the backend idle "
        "for the default sync_idle_s, 0.5 s; a mode with a shorter sync_idle_s resumes batch "
        "work between them)",
    )
    parser.add_argument("--backlog", type=int, default=40, help="items of each backlog batch")
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument(
        "--api",
        choices=("workers-ai", "openai"),
        default="workers-ai",
        help="the surface measured: Workers AI queueRequest and streams, or OpenAI's Batch "
        "API and chat completion streams",
    )
    parser.add_argument(
        "--modes",
        type=json.loads,
        default=MODES,
        help='gateway modes to compare, as JSON {"name": {batch settings}}; the claim is '
        f"checked on the one named {CLAIMED!r}",
    )
    args = parser.parse_args()
    global API
    API = args.api

    data_dir = test_data_dir()
    vllm = None
    if args.vllm_url is None:
        print("starting the tiny vLLM ...", file=sys.stderr)
        vllm = await start_tiny_vllm(data_dir, free_port(), progress=None)
        args.vllm_url = vllm.url
    try:
        modes = await run_modes(args, data_dir, args.vllm_url)
    finally:
        if vllm is not None:
            await vllm.stop()

    ms = 1000.0
    surface = "OpenAI chat" if API == "openai" else "Workers-AI"
    n = args.rounds * args.per_round
    print(
        f"\n{n} sync {surface} streams per phase (max_tokens {args.sync_tokens}, {args.gap} s "
        "apart), idle and "
        f"backlogged phases interleaved over {args.rounds} rounds; backlog {args.backlog} items "
        f"({'an OpenAI batch' if API == 'openai' else 'queueRequest'}) "
        f"(max_tokens {args.batch_tokens}) per round; tiny model on vLLM ({args.vllm_url})"
    )
    print(
        f"{'gateway mode':<20} {'TTFT p50 idle':>14} {'backlog':>9} {'change':>7} "
        f"{'p90 idle':>9} {'backlog':>9} {'items/s during sync':>20} {'alone':>7}"
    )
    verdict = True
    for m in modes:
        idle50, loaded50 = statistics.median(m.idle), statistics.median(m.loaded)
        change = loaded50 / idle50 - 1.0
        during = m.loaded_items / m.loaded_s if m.loaded_s else 0.0
        alone = m.drain_items / m.drain_s if m.drain_s else 0.0
        print(
            f"{m.name:<20} {idle50 * ms:>12.1f}ms {loaded50 * ms:>7.1f}ms {change:>+7.0%} "
            f"{pct(m.idle, 90) * ms:>7.1f}ms {pct(m.loaded, 90) * ms:>7.1f}ms "
            f"{during:>20.2f} {alone:>7.2f}"
        )
        if m.name == CLAIMED:
            verdict = change <= 0.20
    print(
        "\nclaim: with a batch backlog, pull-based sync TTFT p50 within 20 % of idle: "
        f"{'PASS' if verdict else 'FAIL'}"
    )
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
