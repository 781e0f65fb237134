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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.kv.index import PoolBlockIndex
from backends.servers import ServerState

WAITING = "vllm:num_requests_waiting"


def server_load(server: ServerState) -> float:
    """Open requests from this gateway plus those waiting inside vLLM (last scrape)."""
    waiting = 0.0
    for sample in server.upstream:
        if sample.name == WAITING:
            waiting += sample.value
    return server.inflight + waiting


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

    def rank(
        self,
        by_load: Sequence[ServerState],
        blocks: Sequence[int],
        block_size: int,
        prompt_tokens: int,
    ) -> list[ServerState]:
        """``by_load`` (healthy, least loaded first) re-ranked for a request of ``blocks``."""
        if not by_load:
            return []
        role = by_load[0].role
        loads = {s.url: server_load(s) for s in by_load}
        least = min(loads.values())
        ceiling = min(s.inflight for s in by_load) + self.slack
        matched = self.index.matched_blocks(blocks, loads)
        total = max(1, len(blocks))
        scale = self.slack + 1
        held = {url: self.index.size(url) for url in loads}
        most = max(held.values()) or 1

        def score(server: ServerState) -> float:
            hit = matched[server.url] / total
            busy = self.load_weight * (loads[server.url] - least) / scale
            return hit - busy - self.occupancy_weight * held[server.url] / most

        within = [s for s in by_load if s.inflight <= ceiling]
        over = [s for s in by_load if s.inflight > ceiling]
        # sorted() is stable: equal scores keep the least-outstanding order
        ranked = sorted(within, key=score, reverse=True) + over
        best = max(matched.values(), default=0)
        chosen = matched[ranked[0].url]
        if chosen > 0:
            reason = "cache"
        elif best == 0:
            reason = "no_match"
        elif any(matched[s.url] for s in within):
            reason = "load"
        else:
            reason = "bounded"
        self.decisions.reasons[(role, reason)] += 1
        self.decisions.prompt_tokens[role] += prompt_tokens
        self.decisions.predicted_tokens[role] += chosen * block_size
        return ranked
