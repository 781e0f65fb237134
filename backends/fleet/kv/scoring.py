"""Load-aware KV placement: rank a pool's servers by what the request would cost each one,
counted in prompt tokens to compute.

Per candidate server, with ``matched`` the blocks of the request it holds from the first on
(its KV events, ``backends.fleet.kv.index``):

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
costs the request's holders, not the number of servers. The holders are found from their
urls (a map per pool, kept while the pool's servers stay the same), and the walk over the
request's blocks is done once per request: ``cached_tokens`` and a second ranking of the same
blocks reuse it while the index has not changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import UpstreamSample

WAITING = "vllm:num_requests_waiting"

SCORED = 8
"""The least outstanding servers scored for every request, beside the prefix holders."""

POOLS_KEPT = 4
"""Pools whose servers-by-url maps are kept (a backend has two: prefill and decode)."""


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
        self._last: tuple[Sequence[int], int, dict[str, int]] | None = None
        self._pools: list[tuple[list[ServerState], dict[str, ServerState]]] = []

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

    def _matched(self, blocks: Sequence[int]) -> dict[str, int]:
        """``index.matched_holders(blocks)``, walked once per request: the decode and the
        prefill rankings, a ranking again after a wait and ``cached_tokens`` reuse the walk
        for the same blocks (the same object) while the index has not changed."""
        version = self.index.version
        last = self._last
        if last is not None and last[0] is blocks and last[1] == version:
            return last[2]
        holders = self.index.matched_holders(blocks)
        self._last = (blocks, version, holders)
        return holders

    def cached_tokens(self, server: ServerState, blocks: Sequence[int], block_size: int) -> int:
        """Prompt tokens ``server`` holds of a request of ``blocks`` (whole blocks, from the
        first on): what the prefill decision reads for the decode server chosen."""
        return self._matched(blocks).get(server.url, 0) * block_size

    def _by_url(self, pool: Sequence[ServerState]) -> dict[str, ServerState]:
        """``pool``'s servers by url, kept for the last few pools: the same servers in the
        same order (one identity comparison per server, in C) reuse the map."""
        for seen, by_url in self._pools:
            if seen == pool:
                return by_url
        by_url = {s.url: s for s in pool}
        self._pools = [(list(pool), by_url), *self._pools[: POOLS_KEPT - 1]]
        return by_url

    def rank(
        self,
        by_load: Sequence[ServerState],
        blocks: Sequence[int],
        block_size: int,
        prompt_tokens: int,
        pool: Sequence[ServerState],
    ) -> list[ServerState]:
        """``by_load`` (``pool``'s servers to rank, least loaded first) re-ranked for a
        request of ``blocks``."""
        if not by_load:
            return []
        role = by_load[0].role
        holders = self._matched(blocks)
        candidates = list(by_load[:SCORED])
        rest = list(by_load[SCORED:])
        if holders and rest:
            # the holders past the scored few, found from their urls, kept in load order
            by_url = self._by_url(pool)
            held_at = []
            for url in holders:
                server = by_url.get(url)
                if server is None or server in candidates:
                    continue  # another pool's, or scored already
                try:
                    held_at.append(rest.index(server))  # identity first, in C
                except ValueError:
                    continue  # not among the servers to rank (unhealthy, excluded)
            if held_at:
                held_at.sort()
                candidates += [rest[i] for i in held_at]
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
