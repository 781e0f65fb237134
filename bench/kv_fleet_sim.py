"""KV placement on a simulated fleet: the gateway's own placement and scoring code against
8, 32 and 128 simulated vLLM servers, no vLLM.

Each simulated server has an LRU prefix cache of ``--capacity`` blocks and one prefill queue
(a request's prefill takes ``--base-ms`` plus ``--block-ms`` per block it does not hold;
its TTFT is its wait in the queue plus that). After each prefill the server publishes what
it stored and evicted as vLLM's KV event batches (``BlockStored`` / ``BlockRemoved``,
msgpack), which go through ``decode_batch`` and ``ServerFeed.apply_batch`` into the real
``PoolBlockIndex`` that ``kv`` placement reads; a server's open requests (its queue) are its
``ServerState.inflight``.

The trace (seeded): tenants with a system prompt of 10-45 blocks (~320-1,440 tokens),
Zipf popularity over tenants, several conversations per tenant whose turns append 2-4
blocks to their history, Poisson arrivals at ``--load`` of the fleet's prefill capacity
(as if nothing were cached). Each server's KV holds ``--fit`` times the trace's distinct
blocks over the number of servers: at the default 1.5 the working set fits the fleet, not
one server; below 1 it does not fit the fleet either.

Printed per fleet size and policy: the prefix-cache hit rate (blocks held / blocks asked,
as vLLM counts), TTFT p50 / p90 in simulated ms, the most requests one server took over
the mean, and the cost of ``Placement.rank`` per decision (µs, wall clock); per trace, the
ceiling: the hit rate of one server that never evicts (only a block's first request misses).

    taskset -c 1 .venv/bin/python -m bench.kv_fleet_sim
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.config import VllmServer
from backends.kv.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    WireHash,
    decode_batch,
)
from backends.kv.feed import FeedStats, ServerFeed
from backends.kv.hashing import BlockHasher
from backends.kv.index import PoolBlockIndex
from backends.kv.scoring import KvScorer
from backends.kv.settings import PlacementPolicy
from backends.placement import Placement, RouteKey
from backends.servers import ServerState
from bench.lib.support import pct

POLICIES: tuple[PlacementPolicy, ...] = ("kv", "prefix-hash", "round-robin", "least-loaded")
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Request:
    at_ms: float
    tenant: int
    blocks: tuple[int, ...]


def build_trace(args: argparse.Namespace, servers: int, rng: random.Random) -> list[Request]:
    """Tenants' system prompts and growing conversations, Zipf over tenants."""
    tenants = args.tenants_per_server * servers
    system = [
        tuple(rng.getrandbits(63) for _ in range(rng.randint(10, 45))) for _ in range(tenants)
    ]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(tenants)]
    histories: dict[tuple[int, int], tuple[int, ...]] = {}
    mean_blocks = 27.5 + args.turns * 3 / 2
    rate_per_ms = args.load * servers / (args.base_ms + args.block_ms * mean_blocks)
    now = 0.0
    trace = []
    for _ in range(args.requests_per_server * servers):
        now += rng.expovariate(rate_per_ms)
        tenant = rng.choices(range(tenants), weights)[0]
        conversation = (tenant, rng.randrange(args.conversations))
        history = histories.get(conversation, system[tenant])
        if len(history) - len(system[tenant]) >= 4 * args.turns:
            history = system[tenant]  # the conversation ended: a new one starts
        history = history + tuple(rng.getrandbits(63) for _ in range(rng.randint(2, 4)))
        histories[conversation] = history
        trace.append(Request(now, tenant, history))
    return trace


class SimServer:
    """One vLLM server: an LRU prefix cache of blocks and a prefill queue."""

    def __init__(self, state: ServerState, capacity: int, feed: ServerFeed) -> None:
        self.state = state
        self.capacity = capacity
        self.feed = feed
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.free_at = 0.0
        self.finishing: list[float] = []

    def open_requests(self, now: float) -> int:
        while self.finishing and self.finishing[0] <= now:
            heapq.heappop(self.finishing)
        return len(self.finishing)

    def prefill(self, blocks: tuple[int, ...]) -> int:
        """Serve ``blocks``: how many it held from the first on; publishes the events."""
        held = 0
        for block in blocks:
            if block not in self.cache:
                break
            self.cache.move_to_end(block)
            held += 1
        stored: list[WireHash] = list(blocks[held:])
        removed: list[WireHash] = []
        for new in blocks[held:]:
            self.cache[new] = None
            if len(self.cache) > self.capacity:
                removed.append(self.cache.popitem(last=False)[0])
        parent = blocks[held - 1] if held else None
        events: list[KvEvent] = []
        if stored:
            events.append(BlockStored(block_hashes=stored, parent_block_hash=parent))
        if removed:
            events.append(BlockRemoved(block_hashes=removed))
        if events:
            wire = _encoder.encode(EventBatch(time.time(), events))
            self.feed.apply_batch(decode_batch(wire))
        return held


def simulate(
    policy: PlacementPolicy, trace: list[Request], servers: int, args: argparse.Namespace
) -> dict[str, float]:
    index = PoolBlockIndex(10 * args.capacity_blocks)
    hasher = BlockHasher()
    stats = FeedStats()
    fleet = []
    for i in range(servers):
        state = ServerState(VllmServer(url=f"http://10.1.{i // 250}.{i % 250}:8000"), 10**6)
        feed = ServerFeed(state.url, "tcp://sim:1", None, "kv", index, hasher, stats)
        fleet.append(SimServer(state, args.capacity_blocks, feed))
    by_url = {s.state.url: s for s in fleet}
    states = [s.state for s in fleet]
    placement = Placement(
        args.slack, policy, KvScorer(index, args.load_weight, args.slack, args.occupancy_weight)
    )
    asked = held = 0
    ttft, decide_us = [], []
    taken = dict.fromkeys(by_url, 0)
    for request in trace:
        for server in fleet:
            server.state.inflight = server.open_requests(request.at_ms)
        key = RouteKey(
            prefix=f"tenant-{request.tenant}",
            blocks=request.blocks,
            block_size=32,
            prompt_tokens=32 * len(request.blocks),
        )
        t0 = time.perf_counter_ns()
        chosen = by_url[placement.rank(states, key)[0].url]
        decide_us.append((time.perf_counter_ns() - t0) / 1000)
        hit = chosen.prefill(request.blocks)
        asked += len(request.blocks)
        held += hit
        start = max(request.at_ms, chosen.free_at)
        chosen.free_at = start + args.base_ms + args.block_ms * (len(request.blocks) - hit)
        heapq.heappush(chosen.finishing, chosen.free_at)
        ttft.append(chosen.free_at - request.at_ms)
        taken[chosen.state.url] += 1
    mean = len(trace) / servers
    return {
        "hit": held / asked,
        "p50": pct(ttft, 50),
        "p90": pct(ttft, 90),
        "spread": max(taken.values()) / mean,
        "us50": pct(decide_us, 50),
        "us99": pct(decide_us, 99),
        "indexed": index.size(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--tenants-per-server", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=3, help="per tenant")
    parser.add_argument("--turns", type=int, default=4, help="turns before a conversation ends")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--requests-per-server", type=int, default=60)
    parser.add_argument("--load", type=float, default=0.7, help="of the uncached capacity")
    parser.add_argument(
        "--fit", type=float, default=1.5, help="per-server KV = working set / servers * this"
    )
    parser.add_argument("--base-ms", type=float, default=5.0)
    parser.add_argument("--block-ms", type=float, default=2.0)
    parser.add_argument("--slack", type=int, default=2, help="prefix_load_slack")
    parser.add_argument("--load-weight", type=float, default=0.5)
    parser.add_argument("--occupancy-weight", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print(
        f"{'servers':>7} {'policy':>12} {'hit':>6} {'TTFT p50':>9} {'p90':>8} {'max/mean':>8}"
        f" {'rank p50 µs':>11} {'p99 µs':>7} {'indexed':>8}"
    )
    for servers in args.servers:
        trace = build_trace(args, servers, random.Random(args.seed))
        working = {b for r in trace for b in r.blocks}
        args.capacity_blocks = max(1, int(len(working) / servers * args.fit))
        for policy in POLICIES:
            r = simulate(policy, trace, servers, args)
            print(
                f"{servers:>7} {policy:>12} {r['hit']:>6.3f} {r['p50']:>7.0f}ms"
                f" {r['p90']:>6.0f}ms {r['spread']:>8.2f} {r['us50']:>11.1f} {r['us99']:>7.1f}"
                f" {r['indexed']:>8.0f}"
            )
        asked = sum(len(r.blocks) for r in trace)
        ceiling = 1 - len(working) / asked  # every block held from its first request on
        print(
            f"{'':>7} (trace: {len(trace)} requests, {len(working)} distinct blocks,"
            f" {args.capacity_blocks} per server; ceiling hit rate {ceiling:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
