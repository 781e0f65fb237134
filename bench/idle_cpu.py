"""Claim: `make serve` left idle after traffic costs (almost) nothing.

Runs the embedded default the way `make serve` does (`semcache serve`: the gateway, a
prefill and a decode vLLM server over NIXL, the embedded embeddings and classifier), once
with nixl's own progress thread (`nixl_progress_delay_us = 0`: it never sleeps) and once
with the shipped setting, side by side in one run. Each run sends a little traffic (chat
through the P/D hand-off, embeddings, classification), then measures the CPU of the whole
process tree over an idle window, and prints each process group's share of one core and the
ratio of the two settings.

    .venv/bin/python bench/idle_cpu.py [--idle-s 60] [--port 8180]

Target: gateway + every vLLM process <= 5 % of one core in total; the gateway <= 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.support import REPO, ServerProcess, child_env, stderr_printer
from server.config import DEFAULT_CONFIG

say = stderr_printer("idle_cpu")


def config_with(delay_us: int | None, port: int, base_port: int) -> str:
    """The shipped default config, on other ports, with the progress delay set or left."""
    text = DEFAULT_CONFIG.read_text()
    text = text.replace("port = 8080", f"port = {port}")
    for old, new in (("8100", base_port), ("8101", base_port + 1)):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    for old, new in (("5600", base_port + 2), ("5601", base_port + 3)):
        text = text.replace(f"nixl_side_channel_port = {old}", f"nixl_side_channel_port = {new}")
    if delay_us is not None:
        text = text.replace(
            "nixl_side_channel_port =",
            f"nixl_progress_delay_us = {delay_us}, nixl_side_channel_port =",
        )
    return text.replace('data_dir = ".data"', f'data_dir = "{REPO / ".data"}"')


def tree_cpu(root: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants, by kind of process."""
    totals: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        kind = "vLLM" if ("vllm" in cmd or proc.name().startswith("VLLM")) else "gateway"
        totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return totals


async def traffic(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        long_prompt = "Describe the sea. " * 60  # past prefill_threshold_tokens: a P/D hop
        for i in range(3):
            for content in (f"Hello {i}", long_prompt + str(i)):
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "SmolLM2-135M-Instruct",
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 16,
                        "temperature": 0,
                    },
                )
                r.raise_for_status()
        r = await client.post(
            "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["a", "b"]}
        )
        r.raise_for_status()
        r = await client.post("/v1/classify", json={"model": "sentiment-minilm", "input": ["ok"]})
        r.raise_for_status()


async def measure(label: str, delay_us: int | None, args: argparse.Namespace) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix="semcache-idle-"))
    config = folder / "config.toml"
    config.write_text(config_with(delay_us, args.port, args.base_port))
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]
    server = ServerProcess(
        "serve", command, url, folder / "serve.log", child_env(PYTHONPATH=str(REPO)), REPO
    )
    server.start()
    try:
        say(f"{label}: starting semcache serve (log {folder / 'serve.log'})")
        await server.wait_ready(args.ready_timeout_s)
        await traffic(url)
        await asyncio.sleep(args.settle_s)  # the last answers' own work ends
        root = psutil.Process(server.pid)
        before, t0 = tree_cpu(root), time.monotonic()
        await asyncio.sleep(args.idle_s)
        after, elapsed = tree_cpu(root), time.monotonic() - t0
        shares = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / elapsed for k in after}
        shares["total"] = sum(shares.values())
        return shares
    finally:
        await server.stop(grace_s=30)


async def run(args: argparse.Namespace) -> bool:
    results = {}
    for label, delay in (("busy progress thread (delay 0)", 0), ("shipped default", None)):
        results[label] = await measure(label, delay, args)
    print(f"\nidle CPU over {args.idle_s:.0f} s after traffic, share of one core")
    print(f"{'setting':34} {'gateway':>9} {'vLLM':>9} {'total':>9}")
    for label, shares in results.items():
        print(
            f"{label:34} {shares.get('gateway', 0):9.2%} {shares.get('vLLM', 0):9.2%} "
            f"{shares['total']:9.2%}"
        )
    busy, shipped = results.values()
    if shipped["total"] > 0:
        print(f"ratio busy/shipped total: {busy['total'] / shipped['total']:.0f}x")
    return shipped["total"] <= 0.05 and shipped.get("gateway", 0) <= 0.01


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=8180)
    parser.add_argument("--base-port", type=int, default=8190)
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    met = asyncio.run(run(args))
    print("target met" if met else "target not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
