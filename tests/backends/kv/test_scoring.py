"""KV placement's ranking: the tokens a server holds against the tokens of work before it,
the bound, the policies. The tests assert which server wins, not scores, so tuned weights
keep them meaningful."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.kv.scoring import KvScorer
from backends.fleet.placement import Placement, RouteKey
from backends.fleet.server_state import ServerState
from backends.kv_settings import KvSettings
from backends.scraped_metrics import UpstreamSample
from tests.backends.kv.test_index import chat_hashes


def pool(n: int) -> list[ServerState]:
    return [ServerState(VllmServer(url=f"http://10.0.0.{i}:8000"), limit=16) for i in range(n)]


SHIPPED = KvSettings()
"""The ``[backends.kv]`` a config that says nothing gets: the tests score with its weights."""


def kv_placement(
    index: PoolBlockIndex,
    request_cost: float = SHIPPED.request_cost_tokens,
    occupancy: float = SHIPPED.occupancy_weight,
) -> Placement:
    """KV placement as a backend builds it, with the shipped weights (a test's own where it
    isolates one term at its exact break-even)."""
    scorer = KvScorer(index, request_cost_tokens=request_cost, occupancy_weight=occupancy)
    return Placement(2, "kv", scorer)


def key(blocks: list[int]) -> RouteKey:
    return RouteKey(blocks=tuple(blocks), block_size=32, prompt_tokens=len(blocks) * 32)


def test_the_server_holding_the_longest_prefix_wins() -> None:
    """Checked against a scorer blind to the matched blocks: the emptiest server wins."""
    servers = pool(3)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    index.store(servers[1].url, hashes[:5])
    index.store(servers[2].url, hashes[:15])
    placement = kv_placement(index)
    assert placement.rank(servers, key(hashes))[0] is servers[2]
    decisions = placement.kv.decisions if placement.kv else None
    assert decisions is not None
    assert decisions.reasons[("both", "cache")] == 1
    assert decisions.predicted_tokens["both"] == 15 * 32
    assert decisions.prompt_tokens["both"] == len(hashes) * 32


def test_no_match_goes_to_the_least_loaded() -> None:
    """The least loaded server holds the most blocks: one request of load outweighs the
    occupancy. Checked against a scorer blind to load: the emptiest server wins."""
    servers = pool(3)
    servers[0].inflight, servers[1].inflight, servers[2].inflight = 3, 1, 2
    index = PoolBlockIndex(1000)
    index.store(servers[1].url, range(100, 160))  # none of the request's blocks
    placement = kv_placement(index)
    assert placement.rank(servers, key(chat_hashes()))[0] is servers[1]
    assert placement.kv is not None
    assert placement.kv.decisions.reasons[("both", "no_match")] == 1


def test_a_hot_prefix_spreads_once_its_holders_backlog_costs_more_than_computing_it() -> None:
    servers = pool(3)
    hashes = chat_hashes()
    prompt = len(hashes) * 32
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, hashes)
    placement = kv_placement(index, request_cost=0, occupancy=0)  # the backlog term alone
    servers[0].pending_tokens = prompt - 1  # its backlog: just under the prompt
    assert placement.rank(servers, key(hashes))[0] is servers[0]
    servers[0].pending_tokens = prompt + 1  # past it: another server, which then holds it
    assert placement.rank(servers, key(hashes))[0] is servers[1]
    assert placement.kv is not None
    assert placement.kv.decisions.reasons[("both", "spread")] == 1
    index.store(servers[1].url, hashes)
    servers[1].pending_tokens = prompt // 2  # two holders: the cheaper, not a third server
    assert placement.rank(servers, key(hashes))[0] is servers[1]
    assert placement.kv.decisions.reasons[("both", "cache")] == 2


def test_open_requests_weigh_as_tokens_against_the_cached_prefix() -> None:
    servers = pool(2)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, hashes[:2])  # 64 of the prompt's tokens
    placement = kv_placement(index, request_cost=64)
    servers[0].inflight = 1  # 64 tokens of load against 64 held: a tie, the less loaded
    assert placement.rank(servers, key(hashes))[0] is servers[1]
    servers[0].inflight = 0
    servers[1].inflight = 1
    assert placement.rank(servers, key(hashes))[0] is servers[0]


def test_cached_tokens_counts_whole_blocks_from_the_first() -> None:
    servers = pool(2)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, hashes[:4])
    index.store(servers[1].url, hashes[1:9])  # not from the first block: nothing
    scorer = KvScorer(index)
    assert scorer.cached_tokens(servers[0], hashes, 32) == 4 * 32
    assert scorer.cached_tokens(servers[1], hashes, 32) == 0


def test_vllm_waiting_queue_counts_as_load() -> None:
    """Checked against a load of the gateway's open requests only: server 0 wins the tie."""
    servers = pool(2)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, hashes[:2])
    index.store(servers[1].url, hashes[:2])
    servers[0].upstream = [UpstreamSample("vllm:num_requests_waiting", (), 3.0, counter=False)]
    assert kv_placement(index).rank(servers, key(hashes))[0] is servers[1]


def test_a_new_scrape_replaces_the_cached_waiting_queue() -> None:
    """Checked against a waiting queue cached per server URL (the first scrape's kept)."""
    servers = pool(2)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, hashes[:2])
    index.store(servers[1].url, hashes[:2])
    placement = kv_placement(index)
    servers[0].upstream = [UpstreamSample("vllm:num_requests_waiting", (), 3.0, counter=False)]
    assert placement.rank(servers, key(hashes))[0] is servers[1]
    servers[0].upstream = [UpstreamSample("vllm:num_requests_waiting", (), 0.0, counter=False)]
    servers[1].upstream = [UpstreamSample("vllm:num_requests_waiting", (), 3.0, counter=False)]
    assert placement.rank(servers, key(hashes))[0] is servers[0]


def test_matched_blocks_counts_only_prefixes_from_the_first_block() -> None:
    index = PoolBlockIndex(1000)
    index.store("a", [1, 2, 3])
    index.store("b", [2, 3])
    index.store("c", [1, 2])
    assert index.matched_blocks([1, 2, 3, 4], ["a", "b", "c", "d"]) == {
        "a": 3,
        "b": 0,
        "c": 2,
        "d": 0,
    }
    assert index.matched_blocks([], ["a"]) == {"a": 0}
    assert index.sizes(["a", "d"]) == [3, 0]


def test_session_affinity_still_pins_and_no_blocks_falls_back_to_the_hash() -> None:
    """Checked against a fallback by load instead of the prefix hash."""
    servers = pool(4)
    placement = kv_placement(PoolBlockIndex(10))
    pinned = placement.rank(servers, RouteKey(session="conversation-1"))[0]
    assert placement.rank(servers, RouteKey(session="conversation-1"))[0] is pinned
    by_hash = Placement(2).rank(servers, RouteKey(prefix="abc"))
    assert placement.rank(servers, RouteKey(prefix="abc")) == by_hash
    assert placement.kv is not None
    assert placement.kv.decisions.reasons[("both", "fallback")] == 1


def test_round_robin_and_least_loaded_ignore_the_prompt() -> None:
    servers = pool(3)
    rr = Placement(2, "round-robin")
    firsts = [rr.rank(servers, RouteKey(prefix="same"))[0] for _ in range(6)]
    assert firsts == [*servers, *servers]
    servers[0].inflight = 5
    least = Placement(2, "least-loaded")
    assert least.rank(servers, RouteKey(prefix="same"))[0] is not servers[0]


def test_kv_placement_needs_endpoints_and_launched_servers_publish() -> None:
    with pytest.raises(msgspec.ValidationError, match="kv_events"):
        msgspec.convert(
            {
                "name": "m",
                "served_model": "m",
                "placement": "kv",
                "servers": [{"url": "http://a:1"}],
            },
            VllmBackendConfig,
        )
    backend = msgspec.convert(
        {
            "name": "m",
            "served_model": "m",
            "placement": "kv",
            "servers": [
                {
                    "url": "http://127.0.0.1:8001",
                    "kv_events": "tcp://127.0.0.1:5601",
                    "kv_events_replay": "tcp://127.0.0.1:5602",
                    "launch": {},
                }
            ],
        },
        VllmBackendConfig,
    )
    args = backend.servers[0].launch.extra_args if backend.servers[0].launch else []
    events = args[args.index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:5601"' in events and '"replay_endpoint":"tcp://*:5602"' in events
    assert args[args.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"


def test_a_prompt_nobody_holds_goes_where_it_evicts_the_least() -> None:
    """Checked against ``occupancy_weight = 0``: the first server of the rotation wins."""
    servers = pool(3)
    index = PoolBlockIndex(1000)
    index.store(servers[0].url, range(100, 160))
    index.store(servers[1].url, range(200, 210))
    index.store(servers[2].url, range(300, 340))
    placement = Placement(2, "kv", KvScorer(index, occupancy_weight=0.05))
    assert placement.rank(servers, key(chat_hashes()))[0] is servers[1]


def test_equal_holders_of_the_prompt_go_where_it_evicts_the_least() -> None:
    """Two servers hold the whole prompt under the same load; the one that holds fewer blocks
    in all takes it. Checked against ``occupancy_weight = 0``: the first of the rotation
    (the fuller one) wins."""
    servers = pool(2)
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    for server in servers:
        index.store(server.url, hashes)
    index.store(servers[0].url, range(100, 200))  # server 0 holds much more besides
    scorer = KvScorer(
        index,
        request_cost_tokens=SHIPPED.request_cost_tokens,
        occupancy_weight=SHIPPED.occupancy_weight,
    )
    placement = Placement(2, "kv", scorer)
    assert placement.rank(servers, key(hashes))[0] is servers[1]
    assert placement.kv is not None
    assert placement.kv.decisions.reasons[("both", "cache")] == 1


def test_a_large_fleet_scores_the_holders_and_keeps_every_server_once() -> None:
    """Checked against scoring only the least outstanding servers: the holder is missed."""
    servers = pool(40)
    for i, server in enumerate(servers):
        server.inflight = 5 if i < 4 else i % 3  # the holder is not among the 8 least loaded
    hashes = chat_hashes()
    index = PoolBlockIndex(1000)
    holder = servers[31]  # inflight 1
    index.store(holder.url, hashes)
    placement = kv_placement(index)
    ranked = placement.rank(servers, key(hashes))
    assert ranked[0] is holder
    assert sorted(s.url for s in ranked) == sorted(s.url for s in servers)
    rest = ranked[1 + 8 :]  # the holder and the 8 scored; the others in load order
    assert [s.inflight for s in rest] == sorted(s.inflight for s in rest)
    assert {s.inflight for s in ranked[-4:]} == {5}


def test_kv_is_the_default_where_every_server_publishes_its_events() -> None:
    def backend(*servers: dict[str, str]) -> VllmBackendConfig:
        return msgspec.convert(
            {"name": "m", "served_model": "m", "servers": list(servers)}, VllmBackendConfig
        )

    events = {"url": "http://a:1", "kv_events": "tcp://a:2"}
    assert backend(events).placement == "kv"
    assert backend(events, {"url": "http://b:1"}).placement == "prefix-hash"
    assert backend().placement == "prefix-hash"
    shipped = Path(__file__).resolve().parents[3] / "server" / "configs" / "default.toml"
    (chat,) = [b for b in tomllib.loads(shipped.read_text())["backends"] if b["kind"] == "vllm"]
    assert "placement" not in chat  # the default decides
    assert msgspec.convert(chat, VllmBackendConfig).placement == "kv"
