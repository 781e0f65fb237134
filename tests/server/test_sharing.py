"""Sharing answers between tenants, on purpose (fast, fake backend): a rule shares with every
tenant or a share group's members; its headers say of a hit only what the rule reveals, to
every tenant alike; a hidden hit's body looks newly made; an answer shared by a rule that
hides hits is not readable by its digest. The shipped policy shares nothing: that is proven on
``semcache serve`` in ``test_tenant_isolation.py``."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from harness.metrics import parse_metric
from server.app import create_app
from server.config import parse_config

Client = TestClient[Any]
Make = Callable[[str], Client]
ALL = '["status", "age", "saved", "semantic"]'
TOKENS = """
[debug]
adjustable_clock = true
[[auth.tokens]]
token = "tok-admin"
tenant = "ops"
roles = ["admin"]
[[auth.tokens]]
token = "tok-a"
tenant = "acme-eu"
[[auth.tokens]]
token = "tok-b"
tenant = "acme-us"
[[auth.tokens]]
token = "tok-c"
tenant = "globex"
[[auth.tokens]]
token = "tok-partner"
tenant = "initech"
name = "partner"
"""
A, B, C, PARTNER = (
    {"authorization": f"Bearer {t}"} for t in ("tok-a", "tok-b", "tok-c", "tok-partner")
)
CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
EMBED = {"model": "embed-model", "input": "a public sentence"}


@pytest.fixture
def make(fake: FakeGeneration, embedder: LocalEmbeddingBackend, tmp_path: Path) -> Iterator[Make]:
    clients: list[Client] = []

    def start(policy: str) -> Client:
        reg = ModelRegistry()
        reg.generation["fake"] = fake
        reg.embedding["minilm"] = embedder
        reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
        reg.add(ModelInfo("embed-model", "embeddings", (), "t", "minilm", "r", "n"))
        (tmp_path / "policy.toml").write_text(f"version = 1\n{policy}")
        config = parse_config(
            tomllib.loads(
                f'data_dir = "{tmp_path}"\npolicy = "{tmp_path / "policy.toml"}"\n{TOKENS}'
            )
        )
        client = TestClient(create_app(config, registry=reg))
        clients.append(client.__enter__())
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


MISS_STORED = "semcache; fwd=uri-miss; stored"


def test_every_tenant_may_read_again_what_a_fully_revealed_rule_shares(make: Make) -> None:
    client = make(f"[routes.embeddings]\nshared = true\nreveal = {ALL}\n")
    first = client.post("/v1/embeddings", json=EMBED, headers=A)
    assert first.headers["cache-control"].startswith("public, max-age=")
    where = first.headers["content-location"]
    again = client.get(where, headers=C)
    assert again.status_code == 200 and again.content == first.content
    assert again.headers["etag"] == first.headers["etag"]
    assert again.headers["cf-aig-cache-status"] == "HIT"
    cond = client.get(where, headers={**C, "if-none-match": first.headers["etag"]})
    assert cond.status_code == 304 and cond.headers["content-location"] == where
    hit = client.post("/v1/embeddings", json=EMBED, headers=C)
    assert hit.headers["cf-aig-cache-status"] == "HIT" and "x-semcache-saved-tokens" in hit.headers


def test_a_rule_that_hides_hits_answers_every_tenant_as_a_miss(
    make: Make, fake: FakeGeneration
) -> None:
    client = make("[routes.chat]\nshared = true\n")
    first = client.post("/v1/chat/completions", json=CHAT, headers=A)
    assert first.headers["cache-status"].startswith(MISS_STORED)
    for who in (C, A, C):  # another tenant, the one who stored it, a repeat: all alike
        got = client.post("/v1/chat/completions", json=CHAT, headers=who)
        assert got.status_code == 200
        assert got.headers["cf-aig-cache-status"] == "MISS"
        assert got.headers["cache-status"] == first.headers["cache-status"]
        for name in ("age", "x-semcache-saved-tokens", "x-semcache-saved-usd", "content-location"):
            assert name not in got.headers, name
        assert got.headers["cache-control"] == "private, no-cache"
        assert got.headers["vary"] == "Authorization"
        # the body looks newly made: a new id of the same form, the present time
        body, old = got.json(), first.json()
        assert body["id"] != old["id"] and body["id"].startswith("chatcmpl-")
        assert len(body["id"]) == len(old["id"])
        assert abs(body["created"] - time.time()) < 60
        assert body["choices"] == old["choices"]
    assert len(fake.calls) == 1  # it was shared all the same: one backend call
    assert first.headers["cache-control"] == "private, no-cache"
    digest = first.headers["etag"]  # no content URL to read it again by: not an oracle
    assert "content-location" not in first.headers and digest
    # the operator still sees the hits, and what they saved
    page = client.get("/metrics").text
    assert parse_metric(page, "semcache_exact_hits_total", {"model": "chat-model"}) == 3.0


def test_a_streamed_hit_under_a_hiding_rule_reads_as_a_streamed_miss(make: Make) -> None:
    client = make("[routes.chat]\nshared = true\n")
    body = {**CHAT, "stream": True}
    first = client.post("/v1/chat/completions", json=body, headers=A)
    second = client.post("/v1/chat/completions", json=body, headers=C)
    assert first.headers["cache-status"] == second.headers["cache-status"]
    assert "stored" not in second.headers["cache-status"]
    ids = {line for line in second.text.splitlines() if '"id"' in line}
    assert ids and "chatcmpl-fake" not in second.text


def test_a_share_group_shares_among_its_members_only(make: Make, fake: FakeGeneration) -> None:
    client = make(
        '[share_groups.acme]\ntenants = ["acme-eu", "acme-us"]\nkeys = ["partner"]\n'
        f'[routes.chat]\nshared = "acme"\nreveal = {ALL}\n'
    )
    assert (
        client.post("/v1/chat/completions", json=CHAT, headers=A).headers["cf-aig-cache-status"]
        == "MISS"
    )
    for member in (B, PARTNER):
        got = client.post("/v1/chat/completions", json=CHAT, headers=member)
        assert got.headers["cf-aig-cache-status"] == "HIT"
        # a group's answers are never public: they are not everyone's
        assert got.headers["cache-control"].startswith("private, max-age=")
    outsider = client.post("/v1/chat/completions", json=CHAT, headers=C)
    assert outsider.headers["cf-aig-cache-status"] == "MISS"
    assert len(fake.calls) == 2
    where = outsider.headers["content-location"]
    assert client.get(where, headers=C).status_code == 200
    assert client.get(where, headers=B).status_code == 404  # globex's own answer


def test_an_expired_entry_under_a_hiding_rule_reads_as_a_plain_miss(
    make: Make, fake: FakeGeneration
) -> None:
    client = make("[routes.chat]\nshared = true\nttl_s = 1\nswr_s = 0\n")
    client.post("/v1/chat/completions", json=CHAT, headers=A)
    moved = client.post(
        "/admin/debug/clock", json={"advance_s": 5}, headers={"authorization": "Bearer tok-admin"}
    )
    assert moved.status_code == 200, moved.text
    got = client.post("/v1/chat/completions", json=CHAT, headers=C)
    assert got.headers["cf-aig-cache-status"] == "MISS"
    assert got.headers["cache-status"].startswith(MISS_STORED)
    assert len(fake.calls) == 2
