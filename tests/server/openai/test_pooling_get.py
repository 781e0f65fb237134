"""The GET forms of /v1/embeddings and /v1/classify: the same answers and cache keys as the
POST forms, 414 over the limit, 400 naming a bad parameter, 304 on a matching ETag."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import pytest
from litestar.testing import TestClient

from server.errors import ApiError
from server.openai.pooling.query import MAX_QUERY_BYTES, query_body

Client = TestClient[Any]
EMB = "/v1/embeddings"


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_one_input_is_a_string_several_a_list_in_order() -> None:
    assert query_body(b"model=m&input=a+b%2Bc", "embeddings") == {"model": "m", "input": "a b+c"}
    got = query_body(b"input=z&model=m&input=a&input=%C3%A9t%C3%A9", "classification")
    assert got == {"model": "m", "input": ["z", "a", "été"]}
    got = query_body(b"model=m&input=x&dimensions=384&encoding_format=base64", "embeddings")
    assert got == {"model": "m", "input": "x", "dimensions": 384, "encoding_format": "base64"}


@pytest.mark.parametrize(
    ("query", "route", "param", "code"),
    [
        (b"model=m", "embeddings", "input", "missing_required_parameter"),
        (b"input=x", "embeddings", "model", "missing_required_parameter"),
        (b"model=m&input=x&temperature=0", "embeddings", "temperature", "unknown_parameter"),
        (b"model=m&input=x&dimensions=384", "classification", "dimensions", "unknown_parameter"),
        (b"model=m&model=n&input=x", "embeddings", "model", "invalid_value"),
        (b"model=m&input=x&dimensions=big", "embeddings", "dimensions", "invalid_value"),
        (b"model=m&input=%FF", "embeddings", None, "invalid_query"),
        ("model=m&input=\u00e9".encode(), "embeddings", None, "invalid_query"),
    ],
)
def test_bad_query_is_400_naming_the_parameter(
    query: bytes, route: str, param: str | None, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        query_body(query, route)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


def test_query_over_the_limit_is_414() -> None:
    query_body(b"model=m&input=" + b"a" * (MAX_QUERY_BYTES - 14), "embeddings")  # at the limit
    with pytest.raises(ApiError) as caught:
        query_body(b"model=m&input=" + b"a" * (MAX_QUERY_BYTES - 13), "embeddings")
    assert caught.value.status == 414


def test_get_answers_as_post_and_shares_its_cache_key(client: Client) -> None:
    texts = ["the GET form", "and a second text"]
    post = client.post(EMB, json={"model": "embed-model", "input": texts})
    assert post.status_code == 200 and post.headers["cf-aig-cache-status"] == "MISS"
    query = urlencode([("model", "embed-model"), *(("input", t) for t in texts)])
    got = client.get(f"{EMB}?{query}")
    assert got.status_code == 200, got.text
    assert got.headers["cf-aig-cache-status"] == "HIT"
    assert got.headers["x-semcache-key"] == post.headers["x-semcache-key"]
    assert got.json()["data"] == post.json()["data"]
    # One input: the same key as a POST with a string.
    one = client.post(EMB, json={"model": "embed-model", "input": "one text"})
    assert (
        client.get(f"{EMB}?model=embed-model&input=one+text").headers["x-semcache-key"]
        == (one.headers["x-semcache-key"])
    )


def test_get_errors_are_openai_errors_never_stored(client: Client) -> None:
    long = client.get(f"{EMB}?model=embed-model&input=" + "a" * MAX_QUERY_BYTES)
    assert long.status_code == 414
    assert error_of(long)["code"] == "uri_too_long"
    assert long.headers["cache-control"] == "no-store"
    bad = client.get(f"{EMB}?model=embed-model&input=x&stream=true")
    assert bad.status_code == 400 and error_of(bad)["param"] == "stream"
    unknown = client.get(f"{EMB}?model=nope&input=x")
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"
    assert unknown.headers["cache-control"] == "no-store"
    empty = client.get(f"{EMB}?model=embed-model&input=")
    assert empty.status_code == 400 and error_of(empty)["param"] == "input"


def test_an_answer_is_private_with_an_etag_and_304s(client: Client) -> None:
    url = f"{EMB}?model=embed-model&input=etag+text"
    first = client.get(url)
    assert first.headers["cache-control"].startswith("private, max-age=")
    assert first.headers["vary"] == "Authorization"
    etag = first.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')
    again = client.get(url)
    assert again.headers["cf-aig-cache-status"] == "HIT" and again.headers["etag"] == etag
    cond = client.get(url, headers={"if-none-match": f'"other", W/{etag}'})
    assert cond.status_code == 304 and cond.content == b""
    assert cond.headers["etag"] == etag
    assert cond.headers["cache-control"] == again.headers["cache-control"]
    assert client.get(url, headers={"if-none-match": '"other"'}).status_code == 200
    # POST answers say the same (informational: HTTP caches do not reuse POST answers) but
    # never answer 304.
    post = client.post(
        EMB,
        json={"model": "embed-model", "input": "etag text"},
        headers={"if-none-match": etag},
    )
    assert post.status_code == 200 and post.headers["etag"] == etag


def test_uncached_answers_are_no_store(client: Client) -> None:
    url = f"{EMB}?model=embed-model&input=not+stored"
    got = client.get(url, headers={"cache-control": "no-store"})
    assert got.status_code == 200 and got.headers["cache-control"] == "no-store"
    assert "etag" not in got.headers
