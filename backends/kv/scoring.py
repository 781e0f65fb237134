"""Load-aware KV placement: rank a pool's servers by what the request would cost each one,
counted in prompt tokens to compute.

Per candidate server, with ``matched`` the blocks of the request it holds from the first on
(its KV events, ``backends.kv.index``):

    cost = uncached                                  the request's tokens it would compute
         + pending                                   tokens it still has to compute for
                                                     requests sent before (``pending_tokens``)
         + request_cost * (open requests + vLLM's waiting queue)
         + occupancy_weight * prompt tokens * blocks held / the most any candidate holds

and the cheapest goes first (ties: the less loaded, then the rotation of
``least_outstanding``). A prefix's holder therefore takes its requests while its backlog is
shorter than computing the prefix again elsewhere; past that the next request goes to
another server, which then holds the prefix too. A hot prefix so spreads to as many servers
as its demand keeps busy, and no more: once two servers hold it, the cheaper of them takes
the next request. The last term sends a prompt no server holds to the server whose KV holds
the fewest blocks, where it evicts the least.

Scored per request: the ``SCORED`` least outstanding servers and every server holding a
prefix of the request; the others follow in load order, so a decision over a large fleet
costs the request's holders, not the number of servers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.kv.index import PoolBlockIndex
from backends.scraped_metrics import UpstreamSample
from backends.servers import ServerState

WAITING = "vllm:num_requests_waiting"

SCORED = 8
"""The least outstanding servers scored for every request, beside the prefix holders."""


@dataclass
class KvDecisions:
    """What KV placement decided, per pool role (for ``/metrics``)."""

    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(role, reason)``: ``cache`` (the chosen server holds the longest cached prefix),
    ``spread`` (a server holding more of the prompt was busier than computing it again: the
    prefix gains a holder), ``no_match`` (no server holds any of it), ``fallback`` (no exact
    blocks for the request: the prefix hash decided)."""
    predicted_tokens: Counter[str] = field(default_factory=Counter)
    """Per role, prompt tokens the chosen server is predicted to hold already."""
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    """Per role, prompt tokens of the requests KV placement ranked."""


class KvScorer:
    """Ranks servers by the cost of the request on each (see the module docstring)."""

    def __init__(
        self,
        index: PoolBlockIndex,
        *,
        request_cost_tokens: float = 64.0,
        occupancy_weight: float = 0.0,
    ) -> None:
        self.index = index
        self.request_cost = request_cost_tokens
        self.occupancy_weight = occupancy_weight
        self.decisions = KvDecisions()
        self._waiting: dict[str, tuple[list[UpstreamSample], float]] = {}

    def _scraped(self, server: ServerState) -> float:
        """vLLM's waiting queue from the server's last scrape, summed once per scrape: a
        scrape replaces ``server.upstream`` with a new list, so the cache keys on that list."""
        samples = server.upstream
        cached = self._waiting.get(server.url)
        if cached is not None and cached[0] is samples:
            return cached[1]
        waiting = sum(s.value for s in samples if s.name == WAITING)
        self._waiting[server.url] = (samples, waiting)
        return waiting

    def forget(self, server: str) -> None:
        self._waiting.pop(server, None)

    def cached_tokens(self, server: ServerState, blocks: Sequence[int], block_size: int) -> int:
        """Prompt tokens ``server`` holds of a request of ``blocks`` (whole blocks, from the
        first on): what the prefill decision reads for the decode server chosen."""
        return self.index.prefix_depth(server.url, blocks) * block_size

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
        holders = self.index.matched_holders(blocks)
        head = list(by_load[:SCORED])
        rest = list(by_load[SCORED:])
        candidates = head
        if holders and rest:
            held_at = [i for i, s in enumerate(rest) if s.url in holders]
            if held_at:
                candidates = head + [rest[i] for i in held_at]
                for i in reversed(held_at):
                    del rest[i]
        matched = [holders.get(s.url, 0) for s in candidates]
        request = self.request_cost
        costs = [
            max(0, prompt_tokens - m * block_size)
            + s.pending_tokens
            + request * (s.inflight + self._scraped(s))
            for s, m in zip(candidates, matched, strict=True)
        ]
        if self.occupancy_weight:
            held = self.index.sizes([s.url for s in candidates])
            unit = self.occupancy_weight * prompt_tokens / (max(held) or 1)
            costs = [c + unit * h for c, h in zip(costs, held, strict=True)]
        # sort() is stable: equal costs keep the least-outstanding order
        order = sorted(range(len(candidates)), key=costs.__getitem__)
        ranked = [candidates[i] for i in order]
        ranked += rest
        best = max(matched)
        chosen = matched[order[0]]
        if best == 0:
            reason = "no_match"
        elif chosen == best:
            reason = "cache"
        else:
            reason = "spread"
        self.decisions.reasons[(role, reason)] += 1
        self.decisions.prompt_tokens[role] += prompt_tokens
        self.decisions.predicted_tokens[role] += chosen * block_size
        return ranked
