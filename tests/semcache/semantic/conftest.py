"""Fixtures of the semantic-cache tests: the real MiniLM encoder and the shipped verifier."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import PairVerifier, load_verifier
from server.encoders import load_encoder


@pytest.fixture(scope="session")
async def encoder() -> AsyncIterator[Encoder]:
    """all-MiniLM-L6-v2 from its PyPI package, loaded once per session."""
    enc = load_encoder()
    try:
        yield enc
    finally:
        await enc.aclose()


@pytest.fixture(scope="session")
def verifier() -> PairVerifier:
    return load_verifier()
