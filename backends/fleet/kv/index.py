"""The KV blocks each server of a pool holds, by block hash, as its KV events say.

One map from block hash to the servers holding it answers a request's lookup in one pass
over its block hashes (``matched_holders``), whatever the number of servers. The holders of a
block are a bit mask (one bit per server, given at its first store and free again once it
holds nothing): a lookup then touches one small integer per block, not a set and its
strings, which is what keeps a lookup in a large, cold index short. Each server's blocks are
also kept in store order, so its ``AllBlocksCleared`` or a rebuild drops them all, and a
server past ``max_blocks_per_server`` forgets its oldest (counted in ``evicted``). vLLM's
hashes chain every block to all blocks before it, so a block's hash names the whole prefix
that ends with it; like vLLM, a match stops at the first block the server lacks.
``version`` moves with every change, so a lookup may be reused until it does.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice


class PoolBlockIndex:
    """Which server holds which block (see the module docstring)."""

    def __init__(self, max_blocks_per_server: int) -> None:
        self.max_blocks_per_server = max_blocks_per_server
        self._holders: dict[int, int] = {}
        """Block hash → the bits of the servers holding it."""
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._bits: dict[str, int] = {}
        self._urls: list[str] = []
        """Bit → server ("": free)."""
        self.evicted: Counter[str] = Counter()
        """Blocks dropped per server because it reached ``max_blocks_per_server``."""
        self.version = 0
        """Counts the stores, removals and clears: equal versions, equal lookups."""

    def _bit(self, server: str) -> int:
        """``server``'s bit: its own, else the first a cleared server left, else a new one."""
        bit = self._bits.get(server)
        if bit is None:
            urls = self._urls
            try:
                bit = urls.index("")
                urls[bit] = server
            except ValueError:
                bit = len(urls)
                urls.append(server)
            self._bits[server] = bit
        return bit

    def store(self, server: str, hashes: Iterable[int]) -> None:
        self.version += 1
        blocks = self._blocks.setdefault(server, OrderedDict())
        mask = 1 << self._bit(server)
        holders = self._holders
        for block in hashes:
            if block in blocks:
                blocks.move_to_end(block)
                continue
            blocks[block] = None
            holders[block] = holders.get(block, 0) | mask
            if len(blocks) > self.max_blocks_per_server:
                oldest, _ = blocks.popitem(last=False)
                self._forget(mask, oldest)
                self.evicted[server] += 1

    def remove(self, server: str, hashes: Iterable[int]) -> None:
        self.version += 1
        blocks = self._blocks.get(server)
        if blocks is None:
            return
        mask = 1 << self._bits[server]
        for block in hashes:
            if blocks.pop(block, 0) is None:
                self._forget(mask, block)

    def clear(self, server: str) -> None:
        """``server`` holds nothing (a reset, a restart, a rebuild)."""
        self.version += 1
        blocks = self._blocks.pop(server, None)
        bit = self._bits.pop(server, None)
        if bit is None:
            return
        mask = 1 << bit
        for block in blocks or ():
            self._forget(mask, block)
        self._urls[bit] = ""

    def _forget(self, mask: int, block: int) -> None:
        held = self._holders.get(block, 0) & ~mask
        if held:
            self._holders[block] = held
        else:
            self._holders.pop(block, None)

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
        how many blocks from the first on. The walk starts from the first block's holders and
        narrows them block by block, so its cost follows the request's blocks, not the number
        of servers."""
        if not hashes:
            return {}
        holders_of = self._holders.get
        alive = holders_of(hashes[0], 0)
        if not alive:
            return {}
        left: list[tuple[int, int]] = []  # (the servers that dropped out, their depth)
        depth = 1
        for block in islice(hashes, 1, None):
            held = alive & holders_of(block, 0)
            if held != alive:
                left.append((alive & ~held, depth))
                alive = held
                if not alive:
                    break
            depth += 1
        if alive:
            left.append((alive, depth))
        urls = self._urls
        matched: dict[str, int] = {}
        for mask, at in left:
            while mask:
                low = mask & -mask
                matched[urls[low.bit_length() - 1]] = at
                mask ^= low
        return matched
