"""Placement and selective prefill/decode on a simulated fleet: the gateway's own placement
and scoring code against 8, 32 and 128 simulated vLLM servers, on issue 48's workload shapes
(``bench/lib/fleet_shapes.py``), with request costs calibrated from the real servers
(``bench/lib/fleet_calibration.py``, printed first).

Each simulated server has an LRU prefix cache of ``--kv-tokens`` (in 32-token blocks) and one
compute queue: a request's prefill takes ``prefill(uncached tokens)`` of the calibration, in
arrival order; its first token comes at the end of it, then ``max_tokens`` decode steps (which
run beside later prefills). After each placement the server publishes what it stored and
evicted as vLLM's KV event batches (msgpack), which go through ``decode_batch`` and
``ServerFeed.apply_batch`` into the real ``PoolBlockIndex``; its open requests are its
``ServerState.inflight`` and the tokens it has still to prefill its ``pending_tokens``, as
the gateway counts them. Prompts are the shapes' words, one token each (a role token per
message), hashed into 32-token blocks chained as vLLM chains them, salted per tenant.

Placement shapes (``--shape``, every one but long-history): the policies ``kv``,
``prefix-hash``, ``least-loaded``, ``round-robin`` on the same trace, arrivals Poisson at the
shape's fraction of the fleet's saturation rate, measured first (the trace sent in a closed
loop of 4 requests per server through the prefix hash: completed requests per second).
Printed: the ceiling (one server that never evicts: blocks seen before / prompt tokens, as
vLLM counts hits), each policy's hit rate and fraction of it, TTFT p50/p90 (simulated ms),
kv / prefix-hash ratios, the busiest server's share and the decision's cost.

``--shape long-history``: half the servers prefill, half decode; the prefill hop ``always``,
``never`` and ``selective`` (when the decode server chosen lacks ``--threshold`` tokens of
the prompt, from the index). A prefill on a decode server stalls its streams for its length
(one compute queue), so a request's longest inter-token gap is a step plus the longest
prefill that ran there while it decoded. Goodput: requests within ``--slo-ttft-ms`` and
``--slo-itl-ms``.

    taskset -c 1 .venv/bin/python -m bench.kv_fleet_sim [--shape shared-prefix] [--servers 8 32 128]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.config import ServerRole, VllmServer
from backends.fleet.kv.events import BlockRemoved, BlockStored, EventBatch, KvEvent, decode_batch
from backends.fleet.kv.feed import FeedStats, ServerFeed
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.kv.scoring import KvScorer
from backends.fleet.placement import Placement, RouteKey
from backends.fleet.server_state import ServerState
from backends.kv_settings import PlacementPolicy
from bench.lib import fleet_calibration, fleet_shapes
from bench.lib.fleet_calibration import Calibration
from bench.lib.support import pct

BLOCK = 32
POLICIES: tuple[PlacementPolicy, ...] = ("kv", "prefix-hash", "least-loaded", "round-robin")
_encoder = msgspec.msgpack.Encoder()
_ROLE = {"system": 1, "user": 2, "assistant": 3}
_WORD = {w: 100 + i for i, w in enumerate(fleet_shapes.VOCABULARY)}


@dataclass(frozen=True)
class SimRequest:
    at_ms: float
    tenant: str
    blocks: tuple[int, ...]
    tokens: int
    prefix: str
    out: int
    kind: str


def _word_id(word: str) -> int:
    return 1000 + int.from_bytes(hashlib.blake2b(word.encode(), digest_size=2).digest())


def tokens_of(request: fleet_shapes.ShapeRequest) -> list[int]:
    ids: list[int] = []
    for role, content in request.messages:
        ids.append(_ROLE[role])
        ids += [_WORD.get(w) or _word_id(w) for w in content.split()]
    ids.append(4)  # the generation prompt
    return ids


def chain(ids: Sequence[int], salt: str) -> tuple[int, ...]:
    """vLLM's chained block hashes, in miniature: each block names its whole prefix."""
    out, parent = [], int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest())
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(ids[start : start + BLOCK])))
        out.append(parent & 0x7FFF_FFFF_FFFF_FFFF)
    return tuple(out)


def sim_requests(shape: fleet_shapes.Shape, arrivals_ms: Sequence[float]) -> list[SimRequest]:
    out = []
    for at, r in zip(arrivals_ms, shape.requests, strict=True):
        ids = tokens_of(r)
        out.append(
            SimRequest(
                at, r.tenant, chain(ids, r.tenant), len(ids), f"{r.tenant}:{ids[:256]}",
                r.max_tokens, r.kind,
            )
        )  # fmt: skip
    return out


def ceiling(requests: Sequence[SimRequest]) -> float:
    """The hit rate of one server that never evicts (only a block's first sight misses)."""
    seen: set[int] = set()
    hit = 0
    for r in requests:
        hit += BLOCK * sum(1 for b in r.blocks if b in seen)
        seen.update(r.blocks)
    return hit / sum(r.tokens for r in requests)


class SimServer:
    """One vLLM server: an LRU cache of blocks, a compute queue, its open requests."""

    def __init__(self, state: ServerState, capacity: int, feed: ServerFeed) -> None:
        self.state = state
        self.capacity = capacity
        self.feed = feed
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.free_at = 0.0
        self.ends: list[float] = []
        self.firsts: list[tuple[float, int]] = []
        self.stalls: list[tuple[float, float]] = []

    def catch_up(self, now: float) -> None:
        """Open requests and the backlog as the gateway sees them at ``now``."""
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        while self.firsts and self.firsts[0][0] <= now:
            self.state.pending_tokens -= heapq.heappop(self.firsts)[1]
        self.state.inflight = len(self.ends)

    def held(self, blocks: Sequence[int]) -> int:
        n = 0
        for block in blocks:
            if block not in self.cache:
                break
            n += 1
        return n

    def store(self, blocks: Sequence[int]) -> int:
        """Serve ``blocks``: how many it held from the first on; publishes the events."""
        held = self.held(blocks)
        for block in blocks[:held]:
            self.cache.move_to_end(block)
        removed: list[int] = []
        for new in blocks[held:]:
            self.cache[new] = None
            if len(self.cache) > self.capacity:
                removed.append(self.cache.popitem(last=False)[0])
        events: list[KvEvent] = []
        if held < len(blocks):
            parent = blocks[held - 1] if held else None
            events.append(BlockStored(block_hashes=list(blocks[held:]), parent_block_hash=parent))
        if removed:
            events.append(BlockRemoved(block_hashes=list(removed)))
        if events:
            self.feed.apply_batch(decode_batch(_encoder.encode(EventBatch(0.0, events))))
        return held

    def compute(self, at: float, ms: float, uncached: int) -> tuple[float, float]:
        """Queue ``ms`` of prefill: ``(start, end)``; the backlog holds ``uncached`` till then."""
        start = max(at, self.free_at)
        self.free_at = start + ms
        self.state.pending_tokens += uncached
        heapq.heappush(self.firsts, (self.free_at, uncached))
        return start, self.free_at


@dataclass
class Fleet:
    index: PoolBlockIndex
    servers: list[SimServer]
    placement: Placement
    by_url: dict[str, SimServer] = field(default_factory=dict)

    def rank(self, pool: Sequence[SimServer], request: SimRequest) -> SimServer:
        key = RouteKey(
            prefix=request.prefix,
            blocks=request.blocks,
            block_size=BLOCK,
            prompt_tokens=request.tokens,
        )
        return self.by_url[self.placement.rank([s.state for s in pool], key)[0].url]


def make_fleet(
    n: int, policy: PlacementPolicy, capacity: int, roles: Sequence[ServerRole] = ()
) -> Fleet:
    index = PoolBlockIndex(10 * capacity)
    hasher, stats = BlockHasher(), FeedStats()
    servers = []
    for i in range(n):
        role = roles[i] if roles else "both"
        config = VllmServer(url=f"http://10.1.{i // 250}.{i % 250}:8000", role=role)
        state = ServerState(config, 10**6)
        feed = ServerFeed(state.url, "tcp://sim:1", None, "kv", index, hasher, stats)
        servers.append(SimServer(state, capacity, feed))
    placement = Placement(2, policy, KvScorer(index, occupancy_weight=0.05))
    return Fleet(index, servers, placement, {s.state.url: s for s in servers})


def run_placement(
    fleet: Fleet, requests: Sequence[SimRequest], cal: Calibration
) -> dict[str, float]:
    asked = held = 0
    ttft, decide_us = [], []
    taken = dict.fromkeys(fleet.by_url, 0)
    for r in requests:
        for s in fleet.servers:
            s.catch_up(r.at_ms)
        t0 = time.perf_counter_ns()
        chosen = fleet.rank(fleet.servers, r)
        decide_us.append((time.perf_counter_ns() - t0) / 1000)
        hit = chosen.store(r.blocks)
        asked += r.tokens
        held += hit * BLOCK
        uncached = r.tokens - hit * BLOCK
        _, first = chosen.compute(r.at_ms, cal.prefill_ms(uncached), uncached)
        heapq.heappush(chosen.ends, first + r.out * cal.step_ms)
        chosen.state.inflight = len(chosen.ends)
        ttft.append(first - r.at_ms)
        taken[chosen.state.url] += 1
    mean = len(requests) / len(fleet.servers)
    return {
        "hit": held / asked,
        "p50": pct(ttft, 50),
        "p90": pct(ttft, 90),
        "spread": max(taken.values()) / mean,
        "us50": pct(decide_us, 50),
        "us99": pct(decide_us, 99),
        "makespan": max(max(s.free_at for s in fleet.servers), requests[-1].at_ms),
    }


def saturation_per_s(shape: fleet_shapes.Shape, n: int, cap: int, cal: Calibration) -> float:
    """Completed requests/s of the trace in a closed loop of 4 per server (prefix hash)."""
    fleet = make_fleet(n, "prefix-hash", cap)
    reqs = sim_requests(shape, [0.0] * len(shape.requests))
    window = 4 * n
    done: list[float] = [0.0] * window  # when each client's last request finished
    for i, r in enumerate(reqs):
        at = heapq.heappop(done) if i >= window else 0.0
        r = SimRequest(at, r.tenant, r.blocks, r.tokens, r.prefix, r.out, r.kind)
        for s in fleet.servers:
            s.catch_up(at)
        chosen = fleet.rank(fleet.servers, r)
        uncached = r.tokens - chosen.store(r.blocks) * BLOCK
        _, first = chosen.compute(at, cal.prefill_ms(uncached), uncached)
        end = first + r.out * cal.step_ms
        heapq.heappush(chosen.ends, end)
        heapq.heappush(done, end)
    return len(reqs) / (max(done) / 1000)


def placement_shape(args: argparse.Namespace, cal: Calibration) -> None:
    for n in args.servers:
        shape = fleet_shapes.build(args.shape, n, args.kv_tokens, args.requests_per_server * n, 7)
        cap = args.kv_tokens // BLOCK
        sat = saturation_per_s(shape, n, cap, cal)
        rate = shape.rate_fraction * sat
        arrivals = [a * 1000 for a in fleet_shapes.arrivals(len(shape.requests), rate, args.seed)]
        reqs = sim_requests(shape, arrivals)
        top = ceiling(reqs)
        print(
            f"\n{args.shape}, {n} servers: {len(reqs)} requests at {rate:.2f}/s"
            f" ({shape.rate_fraction:.1f} x saturation {sat:.2f}/s), {shape.params};"
            f" ceiling hit rate {top:.3f}"
        )
        print(
            f"  {'policy':>12} {'hit':>6} {'of ceil':>7} {'TTFT p50':>9} {'p90':>8}"
            f" {'max/mean':>8} {'rank p50 µs':>11} {'p99 µs':>7}"
        )
        results = {}
        for policy in args.policy:
            r = run_placement(make_fleet(n, policy, cap), reqs, cal)
            results[policy] = r
            share = r["hit"] / top if top else 1.0
            print(
                f"  {policy:>12} {r['hit']:>6.3f} {share:>7.2f} {r['p50']:>7.0f}ms"
                f" {r['p90']:>6.0f}ms {r['spread']:>8.2f} {r['us50']:>11.1f} {r['us99']:>7.1f}"
            )
        if "kv" in results and "prefix-hash" in results:
            kv, ph = results["kv"], results["prefix-hash"]
            best = min((p for p in results if p != "kv"), key=lambda p: results[p]["p90"])
            print(
                f"  kv / prefix-hash: TTFT p90 {kv['p90'] / ph['p90']:.2f}x, p50"
                f" {kv['p50'] / ph['p50']:.2f}x, hit {kv['hit'] / max(ph['hit'], 1e-9):.2f}x;"
                f" kv / best other ({best}) TTFT p90 {kv['p90'] / results[best]['p90']:.2f}x"
            )


# -- prefill/decode ---------------------------------------------------------------------------


def run_pd(
    mode: str,
    n: int,
    requests: Sequence[SimRequest],
    cal: Calibration,
    args: argparse.Namespace,
    window: int | None = None,
) -> dict[str, float]:
    """One mode over the trace; ``window``: a closed loop of that many clients instead of
    the requests' arrival times (the saturation run)."""
    roles: list[ServerRole] = ["prefill" if i % 2 == 0 else "decode" for i in range(n)]
    fleet = make_fleet(n, "kv", args.kv_tokens // BLOCK, roles)
    prefill = [s for s in fleet.servers if s.state.role == "prefill"]
    decode = [s for s in fleet.servers if s.state.role == "decode"]
    threshold = {"always": 0, "never": 10**9}.get(mode, args.threshold)
    ttft, windows, hops = [], [], 0
    done: list[float] = [0.0] * (window or 0)
    for i, r in enumerate(requests):
        at = (heapq.heappop(done) if i >= window else 0.0) if window else r.at_ms
        for s in fleet.servers:
            s.catch_up(at)
        d = fleet.rank(decode, r)
        uncached_d = r.tokens - d.held(r.blocks) * BLOCK
        if uncached_d < threshold:
            d.store(r.blocks)
            start, first = d.compute(at, cal.prefill_ms(uncached_d), uncached_d)
            d.stalls.append((start, first))
        else:
            hops += 1
            p = fleet.rank(prefill, r)
            uncached_p = r.tokens - p.store(r.blocks) * BLOCK
            _, ready = p.compute(at, cal.prefill_ms(uncached_p), uncached_p)
            heapq.heappush(p.ends, ready)
            d.store(r.blocks)
            first = max(ready + cal.hop_ms, d.free_at + cal.step_ms)
        heapq.heappush(d.ends, first + r.out * cal.step_ms)
        if window:
            heapq.heappush(done, first + r.out * cal.step_ms)
        ttft.append(first - at)
        windows.append((d, first, r.out))
    itl = []
    for d, first, out in windows:
        end, worst = first + out * cal.step_ms, 0.0
        for start, stop in d.stalls:  # prefills on its server while it decodes
            if start < end and stop > first:
                worst = max(worst, stop - max(start, first))
                end += stop - start
        itl.append(cal.step_ms + worst)
    good = sum(
        1 for t, i in zip(ttft, itl, strict=True) if t <= args.slo_ttft_ms and i <= args.slo_itl_ms
    )
    turns = [t for t, r in zip(ttft, requests, strict=True) if r.kind != "fresh"]
    return {
        "p50": pct(ttft, 50),
        "p90": pct(ttft, 90),
        "turn50": pct(turns, 50),
        "itl99": pct(itl, 99),
        "good": good / len(requests),
        "hops": hops / len(requests),
        "per_s": len(requests) / (max(done) / 1000) if window else 0.0,
    }


def pd_shape(args: argparse.Namespace, cal: Calibration) -> None:
    rag = fleet_shapes.long_history(1, args.kv_tokens, 1, random.Random(0)).params["RAG tokens"]
    if args.slo_ttft_ms is None:
        args.slo_ttft_ms = 1.5 * (cal.prefill_ms(float(rag)) + cal.hop_ms)  # type: ignore[arg-type]
    if args.threshold is None:
        args.threshold = cal.break_even(args.slo_itl_ms)
    print(
        f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms (1.5 x a RAG prompt's alone) and the longest"
        f" inter-token gap <= {args.slo_itl_ms:.0f} ms; selective threshold {args.threshold}"
        " uncached tokens (break-even: the most a decode server prefills within the ITL SLO)"
    )
    for n in args.servers:
        shape = fleet_shapes.build(
            "long-history", n // 2, args.kv_tokens, args.requests_per_server * n, 7
        )
        loop = sim_requests(shape, [0.0] * len(shape.requests))
        sat = run_pd("always", n, loop, cal, args, window=4 * n)["per_s"]
        rate = shape.rate_fraction * sat
        arrivals = [a * 1000 for a in fleet_shapes.arrivals(len(shape.requests), rate, args.seed)]
        reqs = sim_requests(shape, arrivals)
        print(
            f"\nlong-history, {n // 2}P{n // 2}D: {len(reqs)} requests at {rate:.2f}/s"
            f" ({shape.rate_fraction:.1f} x always-P/D's saturation {sat:.2f}/s), {shape.params}"
        )
        print(
            f"  {'mode':>10} {'TTFT p50':>9} {'p90':>8} {'turn p50':>9} {'ITL p99':>8}"
            f" {'goodput':>8} {'hops':>5}"
        )
        res = {m: run_pd(m, n, reqs, cal, args) for m in ("always", "never", "selective")}
        for mode, r in res.items():
            print(
                f"  {mode:>10} {r['p50']:>7.0f}ms {r['p90']:>6.0f}ms {r['turn50']:>7.0f}ms"
                f" {r['itl99']:>6.0f}ms {r['good']:>8.2f} {r['hops']:>5.2f}"
            )
        sel, alw, nev = res["selective"], res["always"], res["never"]
        print(
            f"  selective / always TTFT p50 {sel['p50'] / alw['p50']:.2f}x; goodput"
            f" {sel['good']:.2f} vs always {alw['good']:.2f}, never {nev['good']:.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=fleet_shapes.SHAPES, default="shared-prefix")
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--requests-per-server", type=int, default=60)
    parser.add_argument("--kv-tokens", type=int, default=8192, help="one server's KV")
    parser.add_argument("--policy", action="append", choices=POLICIES)
    parser.add_argument("--calibration", type=Path, default=Path(".data/bench/calibration.json"))
    parser.add_argument("--threshold", type=int, help="selective P/D (default: break-even)")
    parser.add_argument("--slo-ttft-ms", type=float, help="default: 1.5 x a RAG prompt alone")
    parser.add_argument("--slo-itl-ms", type=float, default=250.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    args.policy = args.policy or list(POLICIES)
    cal = fleet_calibration.load(args.calibration)
    print(f"calibration: {cal.line()}")
    random.seed(args.seed)
    if args.shape == "long-history":
        pd_shape(args, cal)
    else:
        placement_shape(args, cal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
