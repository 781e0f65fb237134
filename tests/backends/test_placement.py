"""Placement without vLLM: rendezvous stability, prefix keys, least outstanding, prompt size."""

from __future__ import annotations

import uuid
from collections import Counter

from backends.config import VllmServer
from backends.fleet.placement import (
    Placement,
    RouteKey,
    _hash64,
    prefix_key,
    prompt_shape,
    rendezvous_order,
)
from backends.fleet.server_state import ServerState


def servers(n: int, role: str = "decode") -> list[ServerState]:
    return [
        ServerState(VllmServer(url=f"http://10.0.0.{i}:8000", role=role), limit=4)  # type: ignore[arg-type]
        for i in range(n)
    ]


def owners(keys: list[str], pool: list[ServerState]) -> dict[str, str]:
    return {k: rendezvous_order(k, pool)[0].url for k in keys}


def test_rendezvous_is_stable_and_spreads_keys() -> None:
    pool = servers(4)
    keys = [f"session-{i}" for i in range(2000)]
    first = owners(keys, pool)
    assert owners(keys, list(reversed(pool))) == first  # the order of the list does not matter
    per_server = Counter(first.values())
    assert set(per_server) == {s.url for s in pool}
    assert min(per_server.values()) > 2000 / 4 * 0.8


def test_removing_a_server_moves_only_its_sessions() -> None:
    pool = servers(5)
    keys = [uuid.uuid4().hex for _ in range(1000)]
    before = owners(keys, pool)
    gone = pool[2]
    after = owners(keys, [s for s in pool if s is not gone])
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone.url}
    # and they move to their second choice
    assert all(after[k] == rendezvous_order(k, pool)[1].url for k in moved)


def test_adding_a_server_takes_sessions_only_onto_itself() -> None:
    pool = servers(4)
    keys = [uuid.uuid4().hex for _ in range(1000)]
    before = owners(keys, pool[:3])
    after = owners(keys, pool)
    moved = {k for k in keys if before[k] != after[k]}
    assert moved and all(after[k] == pool[3].url for k in moved)


def test_affinity_pins_and_spills_only_when_full() -> None:
    pool = servers(3)
    placement = Placement(prefix_load_slack=2)
    key = RouteKey(session="conversation-7")
    owner = rendezvous_order("conversation-7", pool)[0]
    owner.inflight = 3  # busier than the others, but affinity ignores load below the limit
    assert placement.rank(pool, key)[0] is owner
    owner.healthy = False
    assert owner not in placement.rank(pool, key)
    assert placement.rank(pool, key)[0] is rendezvous_order("conversation-7", pool)[1]


def test_least_outstanding_rotates_among_ties() -> None:
    pool = servers(3)
    placement = Placement(prefix_load_slack=2)
    firsts = Counter(placement.rank(pool, RouteKey())[0].url for _ in range(30))
    assert firsts == Counter({s.url: 10 for s in pool})
    pool[0].inflight, pool[1].inflight, pool[2].inflight = 2, 0, 1
    assert [s.url for s in placement.rank(pool, RouteKey())] == [
        pool[1].url,
        pool[2].url,
        pool[0].url,
    ]


def test_prefix_placement_prefers_the_prefix_owner_within_the_load_slack() -> None:
    pool = servers(3)
    placement = Placement(prefix_load_slack=2)
    key = RouteKey(prefix="abc")
    owner = rendezvous_order("abc", pool)[0]
    assert placement.rank(pool, key)[0] is owner
    owner.inflight = 2  # within the slack of the idle others
    assert placement.rank(pool, key)[0] is owner
    owner.inflight = 3  # beyond it: least outstanding wins
    ranked = placement.rank(pool, key)
    assert ranked[0] is not owner and ranked[0].inflight == 0
    assert ranked[-1] is owner


def test_shared_system_prompts_share_a_prefix_key_and_tenants_do_not() -> None:
    system = "You are the assistant of the library. " * 40

    def key(user: str, scope: str = "tenant-a") -> str | None:
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
        }
        return prefix_key(prompt_shape("/v1/chat/completions", body, 4.0), scope, 256, 4.0)

    assert key("What time is it?") == key("Where is the map?") is not None
    assert key("What time is it?", "tenant-b") != key("What time is it?")
    short = {"messages": [{"role": "user", "content": "Hi"}]}
    assert prefix_key(prompt_shape("/v1/chat/completions", short, 4.0), "t", 256, 4.0) is None


def test_prompt_shape_estimates_tokens_without_a_tokenizer() -> None:
    text = "a" * 400
    chat = prompt_shape(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        4.0,
    )
    assert chat.single and 100 <= chat.approx_tokens <= 110
    completion = prompt_shape("/v1/completions", {"prompt": text}, 4.0)
    assert completion.approx_tokens == 100
    ids = prompt_shape("/v1/completions", {"prompt": list(range(77))}, 4.0)
    assert ids.approx_tokens == 77 and ids.token_ids is not None
    batch = prompt_shape("/v1/completions", {"prompt": ["one", "two"]}, 4.0)
    assert not batch.single
    one = prompt_shape("/v1/completions", {"prompt": [text]}, 4.0)
    assert one.single and one.approx_tokens == 100
    tools = prompt_shape(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        4.0,
    )
    assert tools.text.startswith("[{")


def test_a_responses_body_has_the_shape_of_the_same_chat() -> None:
    system, user = "You are terse. " * 30, "a" * 400
    chat = prompt_shape(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]},
        4.0,
    )
    as_string = prompt_shape("/v1/responses", {"instructions": system, "input": user}, 4.0)
    as_items = prompt_shape(
        "/v1/responses",
        {
            "instructions": system,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": user}]}],
        },
        4.0,
    )
    assert chat == as_string == as_items
    assert prefix_key(as_string, "t", 64, 4.0) == prefix_key(chat, "t", 64, 4.0) is not None
    tool_output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    other = prompt_shape("/v1/responses", {"input": [tool_output]}, 4.0)
    assert other.single and "function_call_output" in other.text


def test_rendezvous_order_is_the_integer_hash_order_it_always_was() -> None:
    """Copying the key's hash state per server must not move any session or prefix."""
    servers = [ServerState(VllmServer(url=f"http://10.1.0.{i}:8000"), limit=4) for i in range(40)]
    for key in ("session-1", "a" * 64, "", "ünïcode"):
        expected = sorted(servers, key=lambda s: _hash64(f"{key}\x00{s.url}"), reverse=True)
        assert rendezvous_order(key, servers) == expected
