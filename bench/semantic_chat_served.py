"""The chat semantic cache through the served process, with and without ``max_tokens``.

Claim checked (issue 60): a chat request that leaves ``max_tokens`` out (most clients do; the
policy's default then applies and is noted in the answer and its key) gets the same semantic
hits as one that names it, in threshold and in verified mode.

One gateway (``semcache serve --no-launch``) in front of a tiny vLLM (random weights: the
answers are noise, the cache's decisions are what is measured). Labelled QQP pairs (the dev
split in ``data/qqp``): each pair's first question is asked, then its second; a semantic hit
on the second is served, and it is right when the pair is labelled a duplicate. Each seed
draws its own pairs, and each (mode, max_tokens) cell runs in its own tenant, so no cell sees
another's entries. The verified mode learns per partition: its cells ask the pairs' first
questions, then the second questions in the seed's order.

**Ceiling**: the duplicate pairs' share, what a perfect policy would serve.

    .venv/bin/python bench/semantic_chat_served.py              # 150 pairs, seeds 0 1 2
    .venv/bin/python bench/semantic_chat_served.py --pairs 40 --seeds 0
"""

from __future__ import annotations

import argparse
import gzip
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import (
    GATEWAY_ENV,
    GATEWAY_MODEL_ID,
    REPO,
    exit_status,
    gateway_ready,
    gateway_toml,
    stderr_printer,
    stop_gateway,
)
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir

say = stderr_printer("semantic-chat-served")
QQP = REPO / "data" / "qqp" / "qqp_pairs_dev.jsonl.gz"
VERIFIED = "bench-chat-verified"
MODES = {"threshold": GATEWAY_MODEL_ID, "verified": VERIFIED}
POLICY = f"""
version = 1
[tiers.disk]
dir = "cache/exact"
[routes.chat.max_tokens]
default = 8
[models."{GATEWAY_MODEL_ID}".routes.chat.semantic]
enabled = true
threshold = 0.9
[models."{VERIFIED}".routes.chat.semantic]
mode = "verified"
judge = "embedding"
"""


def pairs(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` QQP pairs drawn with ``seed``: short single questions, both texts distinct."""
    with gzip.open(QQP, "rt") as f:
        rows = [orjson.loads(line) for line in f]
    rows = [
        r
        for r in rows
        if r["text_a"] != r["text_b"] and max(len(r["text_a"]), len(r["text_b"])) < 120
    ]
    return random.Random(seed).sample(rows, n)


async def ask(
    http: httpx.AsyncClient, url: str, model: str, tenant: str, text: str, max_tokens: bool
) -> str | None:
    """What the semantic cache did: ``hit``, ``explore`` (verified mode), or None."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
    }
    if max_tokens:
        body["max_tokens"] = 8
    r = await http.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {tenant}"}
    )
    r.raise_for_status()
    return r.headers.get("x-semcache-semantic")


async def cell(
    http: httpx.AsyncClient, url: str, mode: str, with_max: bool, seed: int, drawn: list[Any]
) -> tuple[int, int, int]:
    """(served, wrong, explored) on the pairs' second questions."""
    tenant = f"{mode}-{'with' if with_max else 'without'}-{seed}"
    model = MODES[mode]
    for p in drawn:
        await ask(http, url, model, tenant, p["text_a"], with_max)
    served = wrong = explored = 0
    for p in drawn:
        said = await ask(http, url, model, tenant, p["text_b"], with_max)
        if said == "hit":
            served += 1
            wrong += int(p["label"] != 1)
        explored += int(said == "explore")
    return served, wrong, explored


async def run(args: argparse.Namespace) -> bool:
    data_dir = test_data_dir()
    work = Path(tempfile.mkdtemp(prefix="semantic-chat-served-"))
    vllm = await start_tiny_vllm(data_dir, free_port(), progress=None)
    port = free_port()
    (work / "policy.toml").write_text(POLICY)
    toml = gateway_toml(
        data_dir=work,
        port=port,
        vllm_url=vllm.url,
        served=TINY_MODEL_NAME,
        model=data_dir / "models" / TINY_MODEL_NAME,
        embeddings=True,
        extra=f'[[models]]\nid = "{VERIFIED}"\nbackend = "bench"\ntask = "chat"\n',
    )
    (work / "gateway.toml").write_text(f'policy = "{work / "policy.toml"}"\n' + toml)
    gateway = GatewayProcess(work / "gateway.toml", port, GATEWAY_ENV, log=work / "gateway.log")
    ok = True
    try:
        await gateway_ready(gateway, 180)
        print(
            "mode       seed  pairs  duplicates (ceiling)"
            "  with max_tokens: served/wrong/explored  without: served/wrong/explored"
        )
        async with httpx.AsyncClient(timeout=120) as http:
            for seed in args.seeds:
                drawn = pairs(args.pairs, seed)
                ceiling = sum(p["label"] == 1 for p in drawn)
                for mode in MODES:
                    with_max = await cell(http, gateway.url, mode, True, seed, drawn)
                    without = await cell(http, gateway.url, mode, False, seed, drawn)
                    print(
                        f"{mode:<10} {seed:>4}  {len(drawn):>5}  {ceiling:>10}"
                        f"            {'/'.join(map(str, with_max)):>22}"
                        f"  {'/'.join(map(str, without)):>22}",
                        flush=True,
                    )
                    acted = without[0] + without[2]  # served or explored: the cache matched
                    ok = ok and acted > 0 and acted >= 0.9 * (with_max[0] + with_max[2])
    finally:
        await stop_gateway(gateway)
        await vllm.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("met" if ok else "NOT met: requests without max_tokens got fewer semantic hits")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    return exit_status(run(parser.parse_args()), say)


if __name__ == "__main__":
    raise SystemExit(main())
