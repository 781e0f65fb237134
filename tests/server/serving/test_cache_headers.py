"""The headers that tell a downstream HTTP cache what it may do (RFC 9111) and the 304 rule."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from semcache.cache_keys import CacheKey
from semcache.entry import CachedAnswer, encode_entry
from semcache.exact import CacheResult, CacheStatus
from server.http.conditional import etag_matches, not_modified
from server.serving.cache_headers import (
    DIRECTIVE_HEADERS,
    CacheDirectives,
    directives_from,
    edge_headers,
    reshaped,
)

BODY = b'{"object":"list","data":[]}'


def key(scope: str = "shared", epochs: tuple[int, int, int] = (0, 0, 0)) -> CacheKey:
    return CacheKey(
        scope=scope, model_id="m", revision="r", template_fp="t", params_hash="p", epochs=epochs
    )


def stored(ttl_s: int = 600, **fields: object) -> CachedAnswer:
    entry = CachedAnswer.from_json(BODY, model_id="m")
    return msgspec.structs.replace(entry, created_at=1000.0, ttl_s=ttl_s, **fields)


def test_shared_entry_is_public_for_what_is_left_of_its_freshness() -> None:
    res = CacheResult(status=CacheStatus.HIT, key=key(), entry=stored(), age_s=100.4)
    h = edge_headers(res)
    assert h["cache-control"] == "public, max-age=499"
    assert h["age"] == "100" and "vary" not in h


def test_tenant_entry_is_private_and_varies_on_authorization() -> None:
    res = CacheResult(
        status=CacheStatus.MISS, key=key("tenant:key:ab"), entry=stored(), stored=True
    )
    h = edge_headers(res)
    assert h["cache-control"] == "private, max-age=600"
    assert h["vary"] == "Authorization"


def test_stale_entry_must_be_revalidated() -> None:
    res = CacheResult(status=CacheStatus.STALE, key=key(), entry=stored(ttl_s=60), age_s=70)
    assert edge_headers(res)["cache-control"] == "public, max-age=0, must-revalidate"


def test_what_no_cache_may_keep_is_no_store() -> None:
    fresh = CachedAnswer.from_json(BODY)  # never stored (a coalesced waiter's, a bypass)
    cases = [
        CacheResult(status=CacheStatus.BYPASS, key=key(), entry=fresh),
        CacheResult(status=CacheStatus.MISS, key=key(), entry=fresh),
        CacheResult(status=CacheStatus.MISS, key=key(), entry=stored(status=500), stored=True),
        CacheResult(status=CacheStatus.MISS, key=key(), entry=None),
    ]
    for res in cases:
        assert edge_headers(res) == {"cache-control": "no-store"}


def test_etag_is_the_entry_checksum_and_changes_with_a_purge() -> None:
    entry = stored()
    res = CacheResult(status=CacheStatus.HIT, key=key(), entry=entry)
    etag = edge_headers(res)["etag"]
    assert etag == '"' + encode_entry(entry, key().digest)[:16].hex() + '"'
    # A model, scope or global purge changes the key's epochs; a key or tag purge is recorded
    # in the refilled entry; a refill restamps it: each gives another ETag.
    assert (
        edge_headers(CacheResult(status=CacheStatus.HIT, key=key(epochs=(0, 1, 0)), entry=entry))[
            "etag"
        ]
        != etag
    )
    refilled = stored(epochs={"key:0123456789ab": 1})
    assert (
        edge_headers(CacheResult(status=CacheStatus.HIT, key=key(), entry=refilled))["etag"] != etag
    )


def test_if_none_match_uses_weak_comparison() -> None:
    assert etag_matches('"a"', '"a"')
    assert etag_matches('W/"a"', '"a"')
    assert etag_matches('"x", "a"', '"a"')
    assert etag_matches("*", '"a"')
    assert not etag_matches('"b"', '"a"')
    assert not etag_matches(None, '"a"') and not etag_matches('"a"', None)


def test_304_repeats_the_caching_headers_of_the_200() -> None:
    headers = {
        "content-type": "application/json",
        "cache-control": "private, max-age=10",
        "vary": "Authorization",
        "etag": '"a"',
        "age": "3",
        "x-semcache-key": "0123456789ab",
        "x-semcache-saved-tokens": "7",
    }
    got = not_modified(headers, '"a"')
    assert got == {
        "cache-control": "private, max-age=10",
        "vary": "Authorization",
        "etag": '"a"',
        "age": "3",
        "x-semcache-key": "0123456789ab",
    }
    assert not_modified(headers, '"b"') is None


def test_a_reshaped_answer_keeps_its_cache_control_but_no_validator(client: Any) -> None:
    """Workers AI wraps the OpenAI body in its envelope: another representation."""
    r = client.post(
        "/client/v4/accounts/acc/ai/run/@cf/test/embed",
        json={"text": "an envelope"},
        headers={"authorization": "Bearer t"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"].startswith("private, max-age=")
    assert "etag" not in r.headers and "content-location" not in r.headers
    assert reshaped({"ETag": '"a"', "content-location": "/x", "age": "1"}) == {"age": "1"}


class ReadHeaders(Mapping[str, str]):
    """Headers that remember which names were asked for."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.asked: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.asked.add(name)
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.asked.add(name)
        return self.values.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def test_directive_headers_are_every_header_the_cache_reads() -> None:
    # Early hits answer a request with none of DIRECTIVE_HEADERS as if it asked nothing.
    none = ReadHeaders({"authorization": "Bearer k", "x-request-id": "r"})
    assert directives_from(none) == CacheDirectives()
    assert none.asked == DIRECTIVE_HEADERS
    asking = {
        "cache-control": "no-cache",
        "cf-aig-skip-cache": "true",
        "cf-aig-cache-ttl": "60",
        "cf-aig-cache-key": "k",
        "x-semcache-tags": "a",
        "x-semcache-semantic-threshold": "0.9",
    }
    assert set(asking) == DIRECTIVE_HEADERS
    for name, value in asking.items():
        assert directives_from({name: value}) != CacheDirectives(), name


def test_semantic_answers_say_what_their_served_items_saved(client: Any) -> None:
    """A semantic hit or partial answer states its saved tokens as an exact hit does."""
    auth = {"authorization": "Bearer saved-headers"}

    def embed(*texts: str) -> Any:
        r = client.post(
            "/v1/embeddings", json={"model": "embed-model", "input": texts}, headers=auth
        )
        assert r.status_code == 200, r.text
        return r

    first = embed("The river runs to the sea.", "Mountains stand tall.")
    assert "x-semcache-saved-tokens" not in first.headers
    hit = embed("the river runs to the sea.", "mountains stand tall.")  # MiniLM is uncased
    assert hit.headers["x-semcache-semantic"] == "hit"
    assert int(hit.headers["x-semcache-saved-tokens"]) == hit.json()["usage"]["prompt_tokens"]
    assert "x-semcache-saved-usd" in hit.headers
    partial = embed("THE RIVER RUNS TO THE SEA.", "Whales sing in the deep.")
    assert partial.headers["x-semcache-semantic"] == "partial"
    saved = int(partial.headers["x-semcache-saved-tokens"])
    assert 0 < saved < partial.json()["usage"]["prompt_tokens"]
