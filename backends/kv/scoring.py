"""Load-aware KV placement: rank a pool's servers by the longest prefix of the request's
blocks each one holds, weighed against its load.

Per candidate server: ``hit`` = matched blocks / the request's blocks (0..1), ``load`` = its
open requests from this gateway plus vLLM's own waiting queue (as last scraped), and

    score = hit - load_weight * (load - least load) / (slack + 1)
                - occupancy_weight * blocks held / the most any candidate holds

The last term sends a prompt no server holds (and breaks near-ties) to the server whose KV
holds the fewest cached blocks, where it evicts the least.

Bounded load: a server more than ``slack`` requests above the least loaded one is not chosen
for its cache (it comes after the others, by load), so one hot prefix cannot pile onto one
server; its blocks are then computed again on another, which then holds them too. Ties go to
the less loaded server, then the rotation of ``least_outstanding``.

Scored per request: the ``SCORED`` least outstanding servers and every server holding a
prefix of the request; the others follow in load order, so a decision over a large fleet
costs the request's holders, not the number of servers.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from backends.kv.index import PoolBlockIndex
from backends.scraped_metrics import UpstreamSample
from backends.servers import ServerState

WAITING = "vllm:num_requests_waiting"

SCORED = 8
"""The least outstanding servers scored for every request, beside the prefix holders."""

inflight_of = attrgetter("inflight")


@dataclass
class KvDecisions:
    """What KV placement decided, per pool role (for ``/metrics``)."""

    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(role, reason)``: ``cache`` (the chosen server holds a prefix), ``no_match`` (none
    does: least loaded), ``load`` (a holder lost on load), ``bounded`` (every holder was over
    the load bound), ``fallback`` (no exact blocks for the request: the prefix hash
    decided)."""
    predicted_tokens: Counter[str] = field(default_factory=Counter)
    """Per role, prompt tokens the chosen server is predicted to hold already."""
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    """Per role, prompt tokens of the requests KV placement ranked."""


class KvScorer:
    """Ranks servers by cached prefix and load (see the module docstring)."""

    def __init__(
        self, index: PoolBlockIndex, load_weight: float, slack: int, occupancy_weight: float = 0.0
    ) -> None:
        self.index = index
        self.load_weight = load_weight
        self.occupancy_weight = occupancy_weight
        self.slack = slack
        self.decisions = KvDecisions()
        self._waiting: dict[str, tuple[list[UpstreamSample], float]] = {}

    def _scraped(self, server: ServerState) -> tuple[list[UpstreamSample], float]:
        """vLLM's waiting queue from the server's last scrape, summed once per scrape: a
        scrape replaces ``server.upstream`` with a new list, so the cache keys on that list."""
        samples = server.upstream
        entry = (samples, sum(s.value for s in samples if s.name == WAITING))
        self._waiting[server.url] = entry
        return entry

    def forget(self, server: str) -> None:
        self._waiting.pop(server, None)

    def rank(
        self,
        by_load: Sequence[ServerState],
        blocks: Sequence[int],
        block_size: int,
        prompt_tokens: int,
    ) -> list[ServerState]:
        """``by_load`` (healthy, least loaded first) re-ranked for a request of ``blocks``.

        Scored: the ``SCORED`` least outstanding servers and every server holding a prefix of
        the request; the others follow in load order. The decision then costs the request's
        holders, not the fleet's size (the rest are only copied)."""
        if not by_load:
            return []
        role = by_load[0].role
        holders = self.index.matched_holders(blocks)
        fewest = by_load[0].inflight
        ceiling = fewest + self.slack
        head = list(by_load[:SCORED])
        rest = list(by_load[SCORED:])
        candidates = head
        if holders and rest:
            held_at = [i for i, s in enumerate(rest) if s.url in holders]
            if held_at:
                candidates = head + [rest[i] for i in held_at]
                for i in reversed(held_at):
                    del rest[i]
        urls = [s.url for s in candidates]
        cache = self._waiting
        missing = (None, 0.0)
        loads = [
            s.inflight
            + (hit[1] if (hit := cache.get(url, missing))[0] is s.upstream else self._scraped(s)[1])
            for url, s in zip(urls, candidates, strict=True)
        ]
        least = min(loads)
        matched = [holders.get(url, 0) for url in urls]
        held = self.index.sizes(urls)
        load_cost = self.load_weight / (self.slack + 1)
        held_cost = self.occupancy_weight / (max(held) or 1)
        hit_gain = 1 / max(1, len(blocks))
        # one pass computes every score; sort() is stable: equal scores keep the
        # least-outstanding order
        scores = [
            m * hit_gain - load_cost * (load - least) - held_cost * h
            for m, load, h in zip(matched, loads, held, strict=True)
        ]
        within = [i for i, s in enumerate(candidates) if s.inflight <= ceiling]
        within.sort(key=scores.__getitem__, reverse=True)
        ranked = [candidates[i] for i in within]
        over = [s for s in candidates if s.inflight > ceiling]
        # ``rest`` is in load order, so its servers within the bound come first
        cut = bisect_right(rest, ceiling, key=inflight_of)
        ranked += rest[:cut]
        ranked += sorted(over + rest[cut:], key=inflight_of)
        chosen = holders.get(ranked[0].url, 0)
        if chosen > 0:
            reason = "cache"
        elif not any(matched):
            reason = "no_match"
        elif any(matched[i] for i in within):
            reason = "load"
        else:
            reason = "bounded"
        self.decisions.reasons[(role, reason)] += 1
        self.decisions.prompt_tokens[role] += prompt_tokens
        self.decisions.predicted_tokens[role] += chosen * block_size
        return ranked
