"""Fixtures of the tuning tests: the semantic tests' real MiniLM encoder and shipped verifier."""

from __future__ import annotations

from tests.semcache.semantic.conftest import encoder, verifier

__all__ = ["encoder", "verifier"]  # shared fixtures
