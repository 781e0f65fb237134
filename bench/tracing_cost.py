"""What tracing costs per exact hit and per miss: today's gateway, tracing off, tracing on.

Targets, each a ``python -m server.cli serve --no-launch`` process pinned to core 0 with
taskset, all running side by side:

- ``today``: the gateway at ``--baseline`` (default ``main``), from ``git archive`` of that
  revision into a temporary folder, run with this venv; no tracing section (it has none);
- ``default``: this tree, no tracing section (tracing off by default);
- ``off``: this tree, ``[tracing] enabled = false``;
- ``on-1.0`` / ``on-0.1``: this tree, spans exported over OTLP/HTTP to a real receiver
  (``harness/otlp_receiver.py``, in this process) with ``sample_ratio`` 1.0 / 0.1.

The backend is a local HTTP server in this process answering like vLLM (a fixed completion):
hits never reach it, misses cost it the same for every target. This process, the receiver
and ``wrk`` (one thread, a Lua script) share core 1. ``hit``: one fixed temperature-0 chat
request, answered from the exact cache (the early-hit path); ``miss``: a new prompt every
request (a counter in the Lua script), each a miss stored in the cache. Each round runs one
wrk run per kind and target, the targets' order reversed every other round; the median
requests/s of the rounds is printed with its ratio to ``today``. Every run must see no
non-2xx answer nor socket error.

    .venv/bin/python bench/tracing_cost.py                          # 5 s runs, 3 rounds
    .venv/bin/python bench/tracing_cost.py --seconds 3 --rounds 2 --connections 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.chat_hit import HIT_BODY, SERVED, fake_vllm
from bench.lib.support import (
    GATEWAY_ENV,
    REPO,
    exit_status,
    gateway_ready,
    gateway_toml,
    stderr_printer,
    stop_gateway,
    toml_value,
)
from bench.lib.wrk import WrkReport, run_wrk, wrk_version
from harness.gateway import GatewayProcess
from harness.otlp_receiver import OtlpReceiver
from harness.ports import free_port

say = stderr_printer("tracing_cost")
TRACING = {
    "today": None,
    "default": None,
    "off": "enabled = false",
    "on-1.0": "sample_ratio = 1.0",
    "on-0.1": "sample_ratio = 0.1",
}
"""Each target's ``[tracing]`` table (``None``: no table; the ``on`` ones also get the
receiver's endpoint)."""


def config_text(
    data_dir: Path, port: int, upstream: str, tracing: str | None, endpoint: str
) -> str:
    extra: list[str] = []
    if tracing is not None:
        extra += ["[tracing]", tracing]
        if tracing.startswith("sample_ratio"):
            extra.append(f"endpoint = {toml_value(endpoint)}")
    return gateway_toml(
        data_dir=data_dir,
        port=port,
        vllm_url=upstream,
        served=SERVED,
        model=None,
        extra="".join(f"{line}\n" for line in extra),
    )


def baseline_tree(revision: str, into: Path) -> Path:
    """The files of ``revision`` of this repository, unpacked under ``into``."""
    tree = into / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def gateway(tree: Path, config: Path, port: int, log: Path) -> GatewayProcess:
    """The gateway of ``tree`` on core 0 (not yet started)."""
    return GatewayProcess(config, port, GATEWAY_ENV, cores="0", checkout=tree, log=log)


def wrk_script(kind: str, folder: Path) -> Path:
    """The Lua script of one kind: the fixed hit, or a new prompt every request (misses)."""
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"']
    if kind == "hit":
        lines.append(f"wrk.body = [==[{HIT_BODY.decode()}]==]")
    else:
        head, tail = HIT_BODY.decode().split("One sentence.")
        lines += [
            "math.randomseed(os.time())",
            "local n = 0",
            "request = function()",
            "  n = n + 1",
            f'  return wrk.format(nil, nil, nil, [==[{head}]==] .. "miss " .. '
            f"tostring(math.random(1, 1e9)) .. ' ' .. n .. [==[{tail}]==])",
            "end",
        ]
    path = folder / f"{kind}.lua"
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_wrk(url: str, script: Path, connections: int, seconds: int) -> WrkReport:
    """wrk on core 1 against the gateway's chat route."""
    chat = url + "/v1/chat/completions"
    return run_wrk(chat, script, connections=connections, seconds=seconds, core="1").report


async def prime(url: str) -> None:
    """The hit request, sent until the cache answers it (and checked to be a hit)."""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(3):
            r = await client.post(
                url + "/v1/chat/completions",
                content=HIT_BODY,
                headers={"content-type": "application/json"},
            )
            r.raise_for_status()
        if r.headers.get("cf-aig-cache-status") != "HIT":
            raise RuntimeError(f"{url}: the repeated request is not a hit: {dict(r.headers)}")


async def run(args: argparse.Namespace) -> bool:
    os.sched_setaffinity(0, {1})  # this process (fake backend, receiver) beside wrk
    upstream = fake_vllm()
    receiver = OtlpReceiver().start()
    servers: dict[str, GatewayProcess] = {}
    results: dict[tuple[str, str], list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
            folder = Path(tmp)
            base = baseline_tree(args.baseline, folder)
            for name, tracing in TRACING.items():
                port = free_port()
                config = folder / f"{name}.toml"
                text = config_text(folder / name, port, upstream.url, tracing, receiver.endpoint)
                config.write_text(text)
                tree = base if name == "today" else REPO
                servers[name] = gateway(tree, config, port, folder / f"{name}.log")
            for server in servers.values():
                server.start(wait=False)
            for server in servers.values():
                await gateway_ready(server, 240)
                await prime(server.url)
            scripts = {kind: wrk_script(kind, folder) for kind in args.kinds}
            for n in range(args.rounds):
                order = list(servers) if n % 2 == 0 else list(servers)[::-1]
                for kind, script in scripts.items():
                    for name in order:
                        report = await asyncio.to_thread(
                            chat_wrk, servers[name].url, script, args.connections, args.seconds
                        )
                        if report.non_2xx or report.socket_errors:
                            raise RuntimeError(f"{name} {kind}: errors: {report}")
                        results.setdefault((kind, name), []).append(report.rps)
                        say(f"round {n + 1} {kind:4} {name:8} {report.rps:9.0f} req/s")
    finally:
        for server in servers.values():
            await stop_gateway(server)
        receiver.stop()
        upstream.stop()
    print(f"\n{wrk_version()}, -t1 -c{args.connections} -d{args.seconds}s, {args.rounds} rounds;")
    print(f"gateways on core 0, wrk on core 1; today = {args.baseline}")
    print(f"{'kind':5} {'target':8} {'req/s (median)':>15} {'vs today':>9}")
    for kind in args.kinds:
        today = statistics.median(results[(kind, "today")])
        for name in TRACING:
            rps = statistics.median(results[(kind, name)])
            print(f"{kind:5} {name:8} {rps:15.0f} {rps / today:9.3f}")
    print(f"spans received: {len(receiver.spans)}")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--kinds", nargs="+", default=["hit", "miss"], choices=["hit", "miss"])
    parser.add_argument("--baseline", default="main", help="the revision `today` runs")
    return exit_status(run(parser.parse_args(argv)), say)


if __name__ == "__main__":
    raise SystemExit(main())
