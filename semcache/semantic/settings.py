"""Semantic-cache settings of one policy rule (shared by the policy loader and the index)."""

from __future__ import annotations

import msgspec

from semcache.config_types import NonNegFloat, Unit


class SemanticRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """When a request may be answered with the cached answer of a similar request."""

    enabled: bool = False
    threshold: Unit = 0.9
    """Minimum cosine similarity between the new text and a cached text to consider it."""
    min_threshold: Unit = 0.8
    """A request header may tighten the threshold, never loosen it below this bound."""
    verifier: bool = False
    """Ask the trained pair verifier to confirm each candidate (needed for chat)."""
    verifier_min_prob: Unit = 0.9
    candidates: int = 4
    """How many nearest neighbours the ANN search proposes to the verifier."""
    ann_after: int = 50_000
    """A partition switches from exact (flat) search to HNSW past this many entries."""
    max_entries: int = 1_000_000
    """Per partition; the oldest entries are evicted past it."""
    min_label_margin: NonNegFloat = 0.0
    """Classification only: serve a cached answer only when its top label beats the next by
    at least this log-odds margin (a label near the boundary flips under a tiny change of
    the text); 0 serves every match."""
