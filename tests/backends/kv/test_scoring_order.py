"""The decision's shortcuts keep its order: ``Placement.rank`` with KV scoring against a
plain reference (every healthy server sorted by load, the holders pulled out of the rest by a
scan, each candidate's prefix walked on its own) over random fleets, loads, scrapes, indexes,
exclusions, index changes between two rankings of the same request and a server replaced
in its pool."""

from __future__ import annotations

import itertools
import random

from backends.config import VllmServer
from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.kv.scoring import SCORED, WAITING, KvScorer
from backends.fleet.placement import Placement, RouteKey
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import UpstreamSample


def reference(
    servers: list[ServerState],
    skip: set[ServerState],
    start: int,
    index: PoolBlockIndex,
    key: RouteKey,
    request_cost: float,
    occupancy: float,
) -> list[ServerState]:
    """KV placement's ranking written out the long way."""
    assert key.blocks
    healthy = [s for s in servers if s.healthy and s not in skip]
    if not healthy:
        return []
    start %= len(healthy)
    by_load = sorted([*healthy[start:], *healthy[:start]], key=lambda s: s.inflight)
    depth = {s.url: index.prefix_depth(s.url, key.blocks) for s in by_load}
    head, rest = by_load[:SCORED], by_load[SCORED:]
    candidates = head + [s for s in rest if depth[s.url]]
    rest = [s for s in rest if not depth[s.url]]
    costs = []
    for s in candidates:
        waiting = sum(x.value for x in s.upstream if x.name == WAITING)
        costs.append(
            max(0, key.prompt_tokens - depth[s.url] * key.block_size)
            + s.pending_tokens
            + request_cost * (s.inflight + waiting)
        )
    if occupancy:
        held = [index.size(s.url) for s in candidates]
        unit = occupancy * key.prompt_tokens / (max(held) or 1)
        costs = [c + unit * h for c, h in zip(costs, held, strict=True)]
    order = sorted(range(len(candidates)), key=costs.__getitem__)
    return [candidates[i] for i in order] + rest


def test_the_ranking_is_the_reference_order_on_random_fleets() -> None:
    rng = random.Random(48)
    for trial in range(300):
        n = rng.choice([1, 3, 8, 9, 20, 64, 130])
        servers = [
            ServerState(VllmServer(url=f"http://10.1.{trial}.{i}:8000"), limit=8) for i in range(n)
        ]
        index = PoolBlockIndex(rng.choice([40, 1000]))
        chains = [[rng.getrandbits(64) for _ in range(12)] for _ in range(4)]
        for s in servers:
            for chain in rng.sample(chains, k=rng.randrange(0, 3)):
                index.store(s.url, chain[: rng.randrange(1, 13)])
            index.store(s.url, (rng.getrandbits(64) for _ in range(rng.randrange(0, 30))))
            if rng.random() < 0.2:
                index.remove(s.url, rng.sample(chains[0], k=2))
        index.store("http://elsewhere:1", chains[0])  # a holder outside the pool
        for s in servers:
            s.inflight = rng.randrange(0, 4)
            s.pending_tokens = rng.choice([0, 0, rng.randrange(0, 500)])
            s.healthy = rng.random() > 0.1
            if rng.random() < 0.3:
                s.upstream = [UpstreamSample(WAITING, (), float(rng.randrange(0, 3)), False)]
        request_cost = rng.choice([0.0, 64.0])
        occupancy = rng.choice([0.0, 0.05])
        placement = Placement(
            2, "kv", KvScorer(index, request_cost_tokens=request_cost, occupancy_weight=occupancy)
        )
        chain = rng.choice(chains)
        blocks = tuple(chain[: rng.randrange(1, 13)]) if rng.random() < 0.9 else (7,)
        key = RouteKey(blocks=blocks, block_size=16, prompt_tokens=16 * len(blocks) + 5)
        excluded = set(rng.sample(servers, k=min(n, rng.randrange(0, 3))))
        for attempt in range(2):
            start = rng.randrange(0, 1000)
            placement._rr = itertools.count(start)  # the rotation this ranking uses
            expected = reference(servers, excluded, start, index, key, request_cost, occupancy)
            ranked = placement.rank(servers, key, excluded)
            assert ranked == expected, (trial, attempt)
            assert placement.kv is not None
            for s in servers:
                assert placement.kv.cached_tokens(s, blocks, 16) == (
                    index.prefix_depth(s.url, blocks) * 16
                )
            # the index changes between two rankings of the same request
            holder = rng.choice(servers)
            index.store(holder.url, blocks[: rng.randrange(1, len(blocks) + 1)])
            if rng.random() < 0.5:
                index.clear(rng.choice(servers).url)
            # a server leaves and joins again under its url (a new object, the same list)
            i = rng.randrange(0, n)
            servers[i] = ServerState(servers[i].config, limit=8, inflight=servers[i].inflight)
