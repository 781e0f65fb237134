"""The scoring core's arithmetic and the score route's pairing (no server; the cache and
real vLLM: ``tests/server/openai/test_scoring_live.py``)."""

from __future__ import annotations

import pytest

from server.errors import ApiError
from server.openai.scoring.serving import _pairs
from server.serving.scoring import apportion


def test_a_calls_tokens_are_shared_by_its_pairs_in_proportion() -> None:
    pairs = [("q", "a" * 9), ("q", "b" * 19), ("q", "c" * 9)]
    shares = apportion(100, pairs)
    assert sum(shares) == 100
    assert shares[1] > shares[0] and abs(shares[0] - shares[2]) < len(
        pairs
    )  # the remainder goes last
    assert apportion(0, pairs) == [0, 0, 0]
    assert apportion(7, []) == []


def test_pairs_are_one_against_many_or_two_lists_in_order() -> None:
    assert _pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert _pairs("q", "a") == [("q", "a")]
    assert _pairs(["q1", "q2"], ["a", "b"]) == [("q1", "a"), ("q2", "b")]
    with pytest.raises(ApiError, match="2 queries and 3 documents"):
        _pairs(["q1", "q2"], ["a", "b", "c"])
