"""The cost of one KV placement decision as the index and the fleet grow: ``Placement.rank``
(the index lookup and the scoring) over 8, 32 and 128 servers holding 1M indexed blocks
between them, for a request of 50 blocks whose prefix some servers hold, then the tokens the
chosen server lacks (what selective disaggregation compares with its threshold); and, apart, the
request's own preparation (tokenizing a 636-token chat prompt with the tiny Llama's
tokenizer and hashing its blocks). First, the noise floor: a fixed loop of arithmetic of
about a decision's length, timed the same way, whose p99 over p50 is this machine's own.

    flock /tmp/semcache-heavy.lock taskset -c 1 .venv/bin/python -m bench.kv_decision
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.config import VllmServer
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.kv.scoring import KvScorer
from backends.fleet.kv.tokens import PromptTokenizer
from backends.fleet.placement import Placement, RouteKey
from backends.fleet.server_state import ServerState
from bench.lib.support import pct
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir

REQUEST_BLOCKS = 50
FLOOR_LOOP = 3000
"""Iterations of the noise floor's loop: about as long as a decision at 128 servers."""


def row(label: str, blocks: str, times: list[float]) -> str:
    """One line of the table: p50, p99 and max of ``times`` (µs)."""
    return (
        f"{label:>8} {blocks:>9} {pct(times, 50):>8.1f} {pct(times, 99):>8.1f} {max(times):>8.1f}"
    )


def build(
    servers: int, blocks: int, prefixes: int, rng: random.Random
) -> tuple[list[ServerState], PoolBlockIndex, list[list[int]]]:
    """``prefixes`` chains of REQUEST_BLOCKS blocks spread over the servers, then random
    blocks up to ``blocks`` indexed in all."""
    pool = [
        ServerState(VllmServer(url=f"http://10.0.{i // 250}.{i % 250}:8000"), 64)
        for i in range(servers)
    ]
    index = PoolBlockIndex(blocks)
    chains = [[rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)] for _ in range(prefixes)]
    for chain in chains:
        for server in rng.sample(pool, k=min(3, servers)):
            index.store(server.url, chain[: rng.randrange(1, REQUEST_BLOCKS + 1)])
    per_server = (blocks - index.size()) // servers
    for server in pool:
        index.store(server.url, (rng.getrandbits(64) for _ in range(per_server)))
    for server in pool:
        server.inflight = rng.randrange(0, 4)
        server.pending_tokens = rng.randrange(0, 2000)
    return pool, index, chains


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"{'servers':>8} {'blocks':>9} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>8}")
    floor = []
    for _ in range(args.requests):  # the machine's own tail: fixed arithmetic, no memory
        t0 = time.perf_counter_ns()
        sum(range(FLOOR_LOOP))
        floor.append((time.perf_counter_ns() - t0) / 1000)
    print(row("floor", "-", floor), " (a fixed loop of arithmetic timed the same way: noise)")
    for servers in (8, 32, 128):
        pool, index, chains = build(servers, args.blocks, 2000, rng)
        scorer = KvScorer(index, occupancy_weight=0.05)
        placement = Placement(2, "kv", scorer)
        times = []
        for i in range(args.requests):
            chain = chains[i % len(chains)] if i % 4 else [rng.getrandbits(64)] * 1
            key = RouteKey(blocks=tuple(chain), block_size=32, prompt_tokens=32 * len(chain))
            t0 = time.perf_counter_ns()
            chosen = placement.rank(pool, key)[0]
            scorer.cached_tokens(chosen, key.blocks or (), key.block_size)
            times.append((time.perf_counter_ns() - t0) / 1000)
        print(row(str(servers), str(index.size()), times))
    model = build_tiny_llama(test_data_dir() / "models" / TINY_MODEL_NAME)
    tokenizer = PromptTokenizer(model)
    system = " ".join(f"rule {i}: answer briefly and kindly." for i in range(40))
    body = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "hello there"},
        ]
    }
    hasher = BlockHasher()
    tok_us, hash_us = [], []
    for _ in range(500):
        t0 = time.perf_counter_ns()
        ids = tokenizer.prompt_tokens("/v1/chat/completions", body) or []
        t1 = time.perf_counter_ns()
        hasher.event_hashes(ids, 32)
        tok_us.append((t1 - t0) / 1000)
        hash_us.append((time.perf_counter_ns() - t1) / 1000)
    print(
        f"tokenize {len(ids)} tokens: p50 {pct(tok_us, 50):.0f} µs, p99 {pct(tok_us, 99):.0f} µs;"
        f" hash {len(ids) // 32} blocks: p50 {pct(hash_us, 50):.0f} µs,"
        f" p99 {pct(hash_us, 99):.0f} µs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
