"""Semantic-cache settings of one policy rule (shared by the policy loader and the index)."""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import Fraction, NonNegFloat, NonNegInt, PosFloat, PosInt, Unit


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
    mode: Literal["static", "verified"] = "static"
    """``static``: serve every match past the threshold (and verifier). ``verified`` (chat
    only): each entry learns from judged explores when its answer is right, and is served
    only while the share of wrong answers served stays under ``max_error``
    (``semcache.semantic.verified.decisions``); ``threshold`` is then the floor of candidates."""
    max_error: Fraction = 0.05
    """Verified: the bound on the share of wrong answers among those served."""
    min_observations: PosInt = 10
    """Verified: judged explores a partition needs before it serves anything."""
    prior_weight: NonNegFloat = 20.0
    """Verified: how many observations the partition's prior weighs in an entry's curve."""
    prior_bandwidth: PosFloat = 0.01
    """Verified: the prior weighs the partition's observations by a Gaussian kernel of this
    width around the request's score (the partition's curve need not be one sigmoid)."""
    audit_rate: Unit = 0.02
    """Verified: the share of servable requests explored anyway, to keep checking."""
    prior_neighbours: NonNegInt = 64
    """Verified: the prior pools the observations of the matched entry's nearest entries,
    this many (0: the whole partition's), so a partition that mixes workloads learns each
    region's curve."""
    explores_per_minute: PosInt = 60
    """Verified: judged explores per partition per minute; past it a request that would
    explore is a plain miss (sent to the backend, not judged)."""
    judge: Literal["exact", "embedding", "model"] = "exact"
    """Verified: how an explored request's fresh answer is compared with the cached one:
    ``exact`` (equal after normalising case and spacing: temperature-0 answers of a
    deterministic model), ``embedding`` (cosine of the answers' vectors at least
    ``judge_min_similarity``) or ``model`` (the chat model ``judge_model`` is asked whether
    the two answers agree)."""
    judge_min_similarity: Unit = 0.95
    judge_model: str | None = None
    """Verified, ``judge = "model"``: a chat model of the gateway's config (id or alias)
    asked, through its backend, whether two answers agree."""
    judge_max_tokens: PosInt = 4
    """Verified, ``judge = "model"``: the judge's reply is one word (``yes`` or ``no``)."""

    @property
    def verified(self) -> bool:
        return self.enabled and self.mode == "verified"
