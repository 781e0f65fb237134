"""Claim: `make serve` left idle after traffic costs (almost) nothing.

Runs the embedded default the way `make serve` does (`semcache serve`: the gateway, a
prefill and a decode vLLM server over NIXL, the embedded embeddings and classifier), once
with nixl's own progress thread (`nixl_progress_delay_us = 0`: it never sleeps) and once
with the shipped setting, side by side in one run. Each run sends a little traffic (chat
through the P/D hand-off, embeddings, classification), then measures the CPU of the whole
process tree over an idle window, and prints each process group's share of one core and the
ratio of the two settings, with each run's busiest threads (from ``/proc``).

    .venv/bin/python bench/idle_cpu.py [--idle-s 60] [--port 8180] [--top 8]

Target: gateway + every vLLM process <= 5 % of one core in total; the gateway <= 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.support import GATEWAY_ENV, REPO, gateway_ready, stderr_printer, stop_gateway
from harness.gateway import GatewayProcess
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
    for events in range(5610, 5614):  # the servers' KV events and replay sockets
        text = text.replace(f"127.0.0.1:{events}", f"127.0.0.1:{base_port + events - 5606}")
    if delay_us is not None:
        text = text.replace(
            "nixl_side_channel_port =",
            f"nixl_progress_delay_us = {delay_us}, nixl_side_channel_port =",
        )
    return text.replace('data_dir = ".data"', f'data_dir = "{REPO / ".data"}"')


TICK = os.sysconf("SC_CLK_TCK")

ThreadKey = tuple[int, int]
"""(pid, tid)"""
Threads = dict[ThreadKey, tuple[str, int]]
"""(pid, tid) → (thread name, CPU ticks so far)"""


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """tid → (comm, utime + stime in clock ticks) for every thread of ``pid``."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(tid)] = (comm, int(fields[11]) + int(fields[12]))  # utime, stime
    return found


def thread_snapshot(root: psutil.Process) -> tuple[Threads, dict[int, str]]:
    """Every thread's ticks of ``root``'s tree, and each process's short description."""
    ticks: Threads = {}
    names: dict[int, str] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
            name = proc.name()
        except psutil.Error:
            continue
        names[proc.pid] = describe(name, cmd)
        for tid, value in thread_ticks(proc.pid).items():
            ticks[(proc.pid, tid)] = value
    return ticks, names


def describe(name: str, cmd: str) -> str:
    """A process's short name: gateway, a vLLM API server by port, or its own name."""
    if "server.cli" in cmd:
        return "gateway"
    if "--port" in cmd and "vllm" in cmd:
        port = cmd.split("--port", 1)[1].split()[0]
        return f"vLLM api :{port}"
    return f"{name} ({cmd[:60]})"


def report_threads(
    before: Threads,
    after: Threads,
    names: dict[int, str],
    elapsed: float,
    top: int,
) -> None:
    """Print each process's and the ``top`` threads' shares of one core between two snapshots."""
    rows = []
    for key, (comm, end) in after.items():
        start = before.get(key, (comm, 0))[1]
        rows.append(((end - start) / TICK / elapsed, key, comm))
    rows.sort(reverse=True)
    by_process: dict[int, float] = {}
    for share, (pid, _), _ in rows:
        by_process[pid] = by_process.get(pid, 0.0) + share
    total = sum(by_process.values())
    print(f"idle window {elapsed:.0f} s; total {total:.2%} of one core; by process:")
    for pid, share in sorted(by_process.items(), key=lambda item: -item[1]):
        print(f"  {share:7.2%}  pid {pid:<7} {names.get(pid, '?')}")
    print(f"\ntop {top} threads:")
    for share, (pid, tid), comm in rows[:top]:
        print(f"  {share:7.2%}  {comm:16} tid {tid:<7} in pid {pid} {names.get(pid, '?')}")


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


@contextlib.asynccontextmanager
async def serve_default(
    label: str, delay_us: int | None, args: argparse.Namespace
) -> AsyncIterator[tuple[str, GatewayProcess]]:
    """``semcache serve`` with the default config (``config_with``), ready; stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="semcache-idle-"))
    config = folder / "config.toml"
    config.write_text(config_with(delay_us, args.port, args.base_port))
    log = folder / "serve.log"
    server = GatewayProcess(config, args.port, GATEWAY_ENV, launch=True, log=log)
    try:
        say(f"{label}: starting semcache serve (config {config}, log {log})")
        await gateway_ready(server, args.ready_timeout_s)
        yield server.url, server
    finally:
        await stop_gateway(server)


async def measure(label: str, delay_us: int | None, args: argparse.Namespace) -> dict[str, float]:
    async with serve_default(label, delay_us, args) as (url, server):
        await traffic(url)
        await asyncio.sleep(args.settle_s)  # the last answers' own work ends
        root = psutil.Process(server.pid)
        threads_before, _ = thread_snapshot(root)
        before, t0 = tree_cpu(root), time.monotonic()
        await asyncio.sleep(args.idle_s)
        after, elapsed = tree_cpu(root), time.monotonic() - t0
        threads_after, names = thread_snapshot(root)
        shares = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / elapsed for k in after}
        shares["total"] = sum(shares.values())
        if args.top:
            print(f"\n{label}:")
            report_threads(threads_before, threads_after, names, elapsed, args.top)
        return shares


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
    parser.add_argument("--top", type=int, default=8, help="threads listed per setting")
    args = parser.parse_args()
    met = asyncio.run(run(args))
    print("target met" if met else "target not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
