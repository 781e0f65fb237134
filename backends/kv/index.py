"""The KV blocks each server of a pool holds, by block hash, as its KV events say.

One map from block hash to the servers holding it answers a request's lookup in one pass
over its block hashes (``matched_blocks``), whatever the number of servers; each server's
blocks are also kept in store order, so its ``AllBlocksCleared`` or a rebuild drops them
all, and a server past ``max_blocks_per_server`` forgets its oldest (counted in
``evicted``). vLLM's hashes chain every block to all blocks before it, so a block's hash
names the whole prefix that ends with it; like vLLM, a match stops at the first block the
server lacks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence


class PoolBlockIndex:
    """Which server holds which block (see the module docstring)."""

    def __init__(self, max_blocks_per_server: int) -> None:
        self.max_blocks_per_server = max_blocks_per_server
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self.evicted: Counter[str] = Counter()
        """Blocks dropped per server because it reached ``max_blocks_per_server``."""

    def store(self, server: str, hashes: Iterable[int]) -> None:
        blocks = self._blocks.setdefault(server, OrderedDict())
        for block in hashes:
            if block in blocks:
                blocks.move_to_end(block)
                continue
            blocks[block] = None
            self._holders.setdefault(block, set()).add(server)
            if len(blocks) > self.max_blocks_per_server:
                oldest, _ = blocks.popitem(last=False)
                self._forget(server, oldest)
                self.evicted[server] += 1

    def remove(self, server: str, hashes: Iterable[int]) -> None:
        blocks = self._blocks.get(server)
        if blocks is None:
            return
        for block in hashes:
            if blocks.pop(block, 0) is None:
                self._forget(server, block)

    def clear(self, server: str) -> None:
        """``server`` holds nothing (a reset, a restart, a rebuild)."""
        for block in self._blocks.pop(server, ()):
            self._forget(server, block)

    def _forget(self, server: str, block: int) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(server)
            if not holders:
                del self._holders[block]

    def size(self, server: str | None = None) -> int:
        """Blocks indexed for ``server`` (all servers' together when None)."""
        if server is None:
            return sum(len(b) for b in self._blocks.values())
        return len(self._blocks.get(server, ()))

    def holds(self, server: str, block: int) -> bool:
        return block in self._blocks.get(server, ())

    def prefix_depth(self, server: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a request's blocks, in order) ``server`` holds from the
        first on."""
        blocks = self._blocks.get(server)
        if not blocks:
            return 0
        depth = 0
        for block in hashes:
            if block not in blocks:
                break
            depth += 1
        return depth

    def sizes(self, servers: Sequence[str]) -> list[int]:
        """Blocks indexed for each of ``servers``, in order."""
        blocks = self._blocks
        return [len(blocks[s]) if s in blocks else 0 for s in servers]

    def matched_blocks(self, hashes: Sequence[int], servers: Iterable[str]) -> dict[str, int]:
        """For each of ``servers``, how many of ``hashes`` (a request's blocks, in order) it
        holds from the first on."""
        matched = dict.fromkeys(servers, 0)
        for server, depth in self.matched_holders(hashes).items():
            if server in matched:
                matched[server] = depth
        return matched

    def matched_holders(self, hashes: Sequence[int]) -> dict[str, int]:
        """The servers holding a prefix of ``hashes`` (a request's blocks, in order), each with
        how many blocks from the first on. The walk starts from the first block's holders, so
        its cost follows the request's blocks and their holders, not the number of servers."""
        first = self._holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        matched: dict[str, int] = {}
        alive = set(first)
        depth = 1
        holders_of = self._holders.get
        for block in hashes[1:]:
            holders = holders_of(block)
            if holders is not None and alive <= holders:  # the common case: nobody drops out
                depth += 1
                continue
            still = alive & holders if holders else set()
            if len(still) != len(alive):
                for server in alive - still:
                    matched[server] = depth
                alive = still
                if not alive:
                    break
            depth += 1
        for server in alive:
            matched[server] = depth
        return matched
