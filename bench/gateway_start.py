"""Claim: a gateway whose encoder graph was checked at an earlier start starts faster.

`semcache serve --no-launch` with one chat model (no server behind it: the gateway does not
wait for one) and the embedded all-MiniLM-L6-v2, started and stopped in rounds, three ways
side by side in each round:

- ``checked``: an encoder folder whose graph an earlier start checked against torch (the
  load reads torch's kept probe vectors: no torch, no sentence-transformers);
- ``first``: an empty encoder folder (load the torch model, export the graph, check it);
- ``torch``: ``SEMCACHE_ENCODER_RUNTIME=torch`` (the torch model, no ONNX at all).

Prints each way's median and range of seconds from process start to ``/health`` (uvicorn
answers once start-up, the model load included, is done), and the ratios of the medians.

    .venv/bin/python bench/gateway_start.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.support import GATEWAY_ENV, gateway_ready, gateway_toml, stop_gateway
from harness.gateway import GatewayProcess
from harness.ports import free_port

WAYS = ("checked", "first", "torch")


async def start_once(root: Path, way: str, shared: Path, run: int) -> float:
    port = free_port()
    data = root / f"{way}-{run}"
    config = data / "gateway.toml"
    data.mkdir(parents=True)
    toml = gateway_toml(
        data_dir=data,
        port=port,
        vllm_url="http://127.0.0.1:9",
        served="none",
        model=None,
        embeddings=True,
    )
    config.write_text(toml)
    env = {
        "checked": {"SEMCACHE_ENCODER_DIR": str(shared)},
        "first": {"SEMCACHE_ENCODER_DIR": str(data / "encoders")},
        "torch": {"SEMCACHE_ENCODER_RUNTIME": "torch"},
    }[way]
    gateway = GatewayProcess(config, port, {**GATEWAY_ENV, **env}, log=data / "gateway.log")
    try:
        return await gateway_ready(gateway, 120.0, "/health")  # up once the models are loaded
    finally:
        await stop_gateway(gateway)


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gateway-start-") as tmp:
        root = Path(tmp)
        shared = root / "shared-encoders"
        await start_once(root, "first", shared, -1)  # no figure: makes the checked folder
        os.replace(root / "first--1" / "encoders", shared)
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        for run in range(rounds):
            for way in WAYS if run % 2 == 0 else WAYS[::-1]:  # the order flips each round
                seconds[way].append(await start_once(root, way, shared, run))
        load = os.getloadavg()[0]
        print(f"{rounds} rounds, load average {load:.2f}, {os.cpu_count()} CPUs")
        medians = {way: statistics.median(s) for way, s in seconds.items()}
        for way, values in seconds.items():
            low, high = min(values), max(values)
            print(f"  {way:8s} median {medians[way]:.2f} s  [{low:.2f}, {high:.2f}]")
        print(f"  checked / torch: {medians['checked'] / medians['torch']:.2f}")
        print(f"  checked / first: {medians['checked'] / medians['first']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds))
