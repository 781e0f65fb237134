"""Key canonicalisation: equal meaning → one key; any difference that matters → another key."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from semcache.cache_keys import (
    SHARED_SCOPE,
    CacheKey,
    build_key,
    canonical_request,
    is_deterministic,
    scope_for,
    template_fingerprint,
)

BASE_CHAT: dict[str, Any] = {
    "model": "qwen3-0.6b",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
    ],
    "temperature": 0,
    "max_tokens": 32,
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat(**changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(BASE_CHAT)
    body.update(changes)
    return body


def canon(body: dict[str, Any], route: str = "chat") -> bytes:
    return canonical_request(route, body)


EQUIVALENT_CHAT = [
    pytest.param(chat(temperature=0.0), id="temperature 0.0 == 0"),
    pytest.param(dict(reversed(list(chat().items()))), id="key order"),
    pytest.param(chat(stream=True, stream_options={"include_usage": True}), id="stream"),
    pytest.param(
        chat(user="alice", metadata={"a": "b"}, store=False, model="other"), id="bookkeeping"
    ),
    pytest.param(chat(n=1, top_p=1.0, presence_penalty=0, frequency_penalty=0.0), id="defaults"),
    pytest.param(chat(top_k=-1, min_p=0, repetition_penalty=1.0), id="vllm defaults"),
    pytest.param(chat(top_k=0), id="top_k 0 == disabled"),
    pytest.param(chat(seed=None, stop=None, tools=None), id="nulls"),
    pytest.param(chat(response_format={"type": "text"}), id="text response_format"),
    pytest.param(chat(tool_choice="none"), id="tool_choice none without tools"),
    pytest.param(chat(logit_bias={}), id="empty logit_bias"),
    pytest.param(chat(max_tokens=None, max_completion_tokens=32), id="max_completion_tokens"),
    pytest.param(chat(priority=5, request_id="r-1", cache_salt="s"), id="vllm scheduling"),
    pytest.param(
        chat(
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
                {"role": "user", "content": "Capital of France?", "name": None},
            ]
        ),
        id="single text part and null name",
    ),
]


@pytest.mark.parametrize("variant", EQUIVALENT_CHAT)
def test_equal_meaning_gives_one_key(variant: dict[str, Any]) -> None:
    assert canon(variant) == canon(chat())


def test_stop_is_a_set() -> None:
    assert canon(chat(stop="END")) == canon(chat(stop=["END"]))
    assert canon(chat(stop=["a", "b"])) == canon(chat(stop=["b", "a", "a"]))
    assert canon(chat(stop=[])) == canon(chat())


def test_tool_choice_auto_is_default_with_tools() -> None:
    with_tools = chat(tools=[WEATHER_TOOL])
    assert canon({**with_tools, "tool_choice": "auto"}) == canon(with_tools)
    assert canon({**with_tools, "tool_choice": "required"}) != canon(with_tools)


def test_other_routes_normalise_aliases() -> None:
    assert canon({"prompt": ["Hi"], "max_tokens": 16}, "completions") == canon(
        {"prompt": "Hi"}, "completions"
    )
    assert canon({"input": ["Hi"], "encoding_format": "float"}, "embeddings") == canon(
        {"input": "Hi"}, "embeddings"
    )
    assert canon({"input": "x"}, "embeddings") != canon({"input": "x"}, "classification")
    # Two prompts are two choices: not the same as one.
    assert canon({"prompt": ["Hi", "Ho"]}, "completions") != canon({"prompt": "Hi"}, "completions")


DIFFERENT_CHAT = [
    pytest.param(chat(messages=[{"role": "user", "content": "Capital of Spain?"}]), id="messages"),
    pytest.param(
        chat(messages=[*BASE_CHAT["messages"], {"role": "assistant", "content": "Paris"}]),
        id="extra message",
    ),
    pytest.param(
        chat(
            messages=[{"role": "developer", "content": "You are terse."}, BASE_CHAT["messages"][1]]
        ),
        id="role",
    ),
    pytest.param(chat(temperature=0.7), id="temperature"),
    pytest.param(chat(top_p=0.9), id="top_p"),
    pytest.param(chat(top_k=5), id="top_k"),
    pytest.param(chat(min_p=0.05), id="min_p"),
    pytest.param(chat(max_tokens=64), id="max_tokens"),
    pytest.param(chat(stop=["\n"]), id="stop"),
    pytest.param(chat(seed=7), id="seed"),
    pytest.param(chat(n=2), id="n"),
    pytest.param(chat(logprobs=True), id="logprobs"),
    pytest.param(chat(presence_penalty=0.5), id="presence_penalty"),
    pytest.param(chat(frequency_penalty=0.5), id="frequency_penalty"),
    pytest.param(chat(repetition_penalty=1.1), id="repetition_penalty"),
    pytest.param(chat(logit_bias={"1234": -100}), id="logit_bias"),
    pytest.param(chat(tools=[WEATHER_TOOL]), id="tools"),
    pytest.param(chat(response_format={"type": "json_object"}), id="response_format"),
    pytest.param(chat(chat_template_kwargs={"enable_thinking": False}), id="template kwargs"),
    pytest.param(chat(some_future_param=1), id="unknown field is kept"),
]


@pytest.mark.parametrize("variant", DIFFERENT_CHAT)
def test_any_meaningful_difference_gives_another_key(variant: dict[str, Any]) -> None:
    assert canon(variant) != canon(chat())


def test_schemas_keep_their_order_and_spelling() -> None:
    """Tool schemas are rendered into the prompt: property order and 1 vs 1.0 can matter."""
    reordered = copy.deepcopy(WEATHER_TOOL)
    props = reordered["function"]["parameters"]["properties"]
    reordered["function"]["parameters"]["properties"] = dict(reversed(list(props.items())))
    assert canon(chat(tools=[reordered])) != canon(chat(tools=[WEATHER_TOOL]))
    a = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": 1}}}
    b = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": 1.0}}}
    assert canon(chat(response_format=a)) != canon(chat(response_format=b))


# --------------------------------------------------------------------------- randomized

_DOMAINS: dict[str, list[Any]] = {
    "temperature": [0, 0.2, 0.7, 1.5],
    "top_p": [0.5, 0.9, 0.95],
    "max_tokens": [8, 32, 256],
    "seed": [0, 1, 42],
    "stop": [["\n"], ["END"], ["a", "b"]],
    "presence_penalty": [0.3, -0.5],
    "frequency_penalty": [0.4, 1.2],
    "n": [2, 3],
    "top_k": [1, 5, 40],
    "logprobs": [True],
}
_TEXTS = ["hi", "Capital of France?", "Translate 'cat'", "2+2=?", "Say something nice"]
_DEFAULTS: dict[str, Any] = {
    "temperature": 1,
    "top_p": 1.0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0,
    "top_k": -1,
    "logprobs": False,
    "stop": None,
    "seed": None,
}


def _random_body(rng: random.Random) -> dict[str, Any]:
    msgs = [{"role": "user", "content": rng.choice(_TEXTS)}]
    if rng.random() < 0.5:
        msgs.insert(0, {"role": "system", "content": rng.choice(_TEXTS)})
    body: dict[str, Any] = {"messages": msgs}
    for k in rng.sample(list(_DOMAINS), rng.randint(0, 5)):
        body[k] = copy.deepcopy(rng.choice(_DOMAINS[k]))
    return body


def _same_meaning(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for k, v in _DEFAULTS.items():  # spell out some defaults
        if k not in out and rng.random() < 0.5:
            out[k] = v
    for k, v in list(out.items()):  # 1 → 1.0
        if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.5:
            out[k] = float(v)
    if isinstance(out.get("stop"), list) and len(out["stop"]) == 1 and rng.random() < 0.5:
        out["stop"] = out["stop"][0]
    for m in out["messages"]:
        if rng.random() < 0.5:
            m["content"] = [{"type": "text", "text": m["content"]}]
    out.update(rng.choice([{}, {"stream": True}, {"user": "u1"}, {"model": "x"}]))
    items = list(out.items())
    rng.shuffle(items)
    return dict(items)


def _different(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    if rng.random() < 0.3:
        m = out["messages"][-1]
        m["content"] = m["content"] + "!"
        return out
    k = rng.choice([k for k, vs in _DOMAINS.items() if any(v != out.get(k) for v in vs)])
    out[k] = copy.deepcopy(rng.choice([v for v in _DOMAINS[k] if v != out.get(k)]))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_randomized_equivalence_and_difference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        body = _random_body(rng)
        key = canon(body)
        assert canon(_same_meaning(rng, body)) == key
        assert canon(_different(rng, body)) != key


# --------------------------------------------------------------------------- other parts


def test_determinism() -> None:
    assert is_deterministic("chat", chat(temperature=0))
    assert is_deterministic("chat", chat(temperature=0.8, seed=3))
    assert is_deterministic("chat", chat(temperature=0.8, top_k=1))
    assert not is_deterministic("chat", chat(temperature=0.8))
    assert not is_deterministic("chat", {"messages": []})  # OpenAI default temperature is 1
    assert is_deterministic("chat", {"messages": []}, sampling_defaults={"temperature": 0})
    assert not is_deterministic("completions", {"prompt": "x", "temperature": True})
    assert is_deterministic("embeddings", {"input": "x"})
    assert is_deterministic("classification", {"input": "x"})


def test_responses_requests_keep_their_shape_and_drop_defaults() -> None:
    base = {"model": "m", "input": "Capital of France?", "temperature": 0, "store": False}
    key = canonical_request("responses", base)
    # bookkeeping and documented defaults change nothing
    for same in ({"store": True}, {"metadata": {"a": "b"}}, {"top_p": 1.0}, {"tools": []}):
        assert canonical_request("responses", {**base, **same}) == key
    # a streamed and a JSON answer are cached apart; anything the model reads matters
    for other in ({"stream": True}, {"instructions": "Be terse."}, {"max_output_tokens": 4}):
        assert canonical_request("responses", {**base, **other}) != key
    assert canonical_request("chat", base) != key
    custom = {"scope": "t", "model_id": "m", "revision": "r", "custom_key": "k"}
    as_json = build_key(route="responses", body=base, **custom)
    assert build_key(route="responses", body={**base, "stream": True}, **custom) != as_json
    assert build_key(route="responses", body={**base, "input": "other"}, **custom) == as_json
    assert is_deterministic("responses", base)
    assert is_deterministic("responses", {**base, "temperature": 0.7, "seed": 1})
    assert not is_deterministic("responses", {"input": "x"})


def test_sampling_defaults_of_a_model_change_equivalence() -> None:
    gen = {"temperature": 0.6}
    assert canonical_request("chat", chat(temperature=0.6), sampling_defaults=gen) == (
        canonical_request(
            "chat", {k: v for k, v in chat().items() if k != "temperature"}, sampling_defaults=gen
        )
    )


def test_template_fingerprint_follows_template_and_system_prompt() -> None:
    fp = template_fingerprint("tmpl-a", chat())
    assert fp == template_fingerprint("tmpl-a", chat(temperature=0.5))
    assert fp != template_fingerprint("tmpl-b", chat())
    other_system = chat(
        messages=[{"role": "system", "content": "Be verbose."}, BASE_CHAT["messages"][1]]
    )
    assert fp != template_fingerprint("tmpl-a", other_system)


def _key(**over: Any) -> CacheKey:
    args: dict[str, Any] = {
        "route": "chat",
        "body": chat(),
        "scope": scope_for("acme", shared=False),
        "model_id": "m",
        "revision": "r1",
        "chat_template_fp": "t",
    }
    args.update(over)
    return build_key(**args)


def test_every_key_part_changes_the_digest() -> None:
    base = _key()
    variants = [
        _key(scope=scope_for("other", shared=False)),
        _key(scope=SHARED_SCOPE),
        _key(model_id="m2"),
        _key(revision="r2"),
        _key(chat_template_fp="t2"),
        _key(body=chat(temperature=0.3)),
        _key(route="completions"),
        _key(epochs=(1, 0, 0)),
        _key(epochs=(0, 1, 0)),
        _key(epochs=(0, 0, 1)),
    ]
    digests = {base.digest, *(v.digest for v in variants)}
    assert len(digests) == len(variants) + 1
    assert _key().digest == base.digest
    assert len(base.digest) == 64 and base.short_id == base.digest[:12]


def test_custom_key_replaces_params_within_scope_and_model() -> None:
    a = _key(custom_key="faq-42")
    assert a.digest == _key(custom_key="faq-42", body=chat(temperature=0.9)).digest
    assert a.digest != _key(custom_key="faq-43").digest
    assert a.digest != _key(custom_key="faq-42", scope=scope_for("other", shared=False)).digest
    assert a.digest != _key(custom_key="faq-42", revision="r2").digest
    assert a.digest != _key().digest


def test_tenant_named_shared_is_not_the_shared_scope() -> None:
    assert scope_for("shared", shared=False) != scope_for("x", shared=True)


@pytest.mark.parametrize("route", ["chat", "embeddings", "classification"])
@pytest.mark.parametrize("value", [1e308, -1e308, 2.0**63, 1e19])
def test_integral_floats_beyond_64_bits_stay_floats(route: str, value: float) -> None:
    body = {"model": "m", "input": ["good"], "messages": [{"role": "user", "content": "x"}]}
    small = canonical_request(route, {**body, "logit_bias": 1.0, "extra": 3.0})
    assert b'"extra":3' in small  # integral floats within 64 bits still become ints
    wide = canonical_request(route, {**body, "logit_bias": value, "extra": value})
    assert canonical_request(route, {**body, "logit_bias": value, "extra": value}) == wide
    assert wide != small


def test_model_defaults_are_filled_in_per_route() -> None:
    gen = {"temperature": 0.6, "max_tokens": 64}
    bare = {k: v for k, v in chat().items() if k not in ("temperature", "max_tokens")}
    # omitted → the model's default; spelled out as OpenAI's default → a different request
    assert canonical_request("chat", bare, sampling_defaults=gen) != canonical_request(
        "chat", {**bare, "temperature": 1}, sampling_defaults=gen
    )
    assert canonical_request("chat", bare, sampling_defaults=gen) == canonical_request(
        "chat", {**bare, "temperature": 0.6, "max_tokens": 64}, sampling_defaults=gen
    )
    # a completions request's omitted max_tokens is 16 whatever the model says
    prompt = {"model": "m", "prompt": "p"}
    assert canonical_request("completions", prompt, sampling_defaults=gen) == canonical_request(
        "completions", {**prompt, "temperature": 0.6}
    )
    # pooling routes take no sampling defaults
    embed = {"model": "m", "input": "x"}
    assert canonical_request("embeddings", embed, sampling_defaults=gen) == canonical_request(
        "embeddings", embed
    )
