"""A model of the global pool for replaying traces at any number of nodes: N nodes of LRU
caches, filled as the pool client fills them (`kvstore.client.placement`), read as it
reads (what the serving node holds first, then one lookup for the rest), counting the
Redis work each request costs.

Per-node caches (`shared=False`) are the same nodes without the pool: a request hits only
what its own node holds, and stores what missed there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.client import placement
from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition


class Served(NamedTuple):
    """What one request did to the pool."""

    num_hit: int  # blocks of its prefix found
    looked_up: bool  # it asked the index (its node did not hold the whole prefix)
    groups_looked_up: int  # chain groups read in that lookup: Redis commands, one round
    num_stored: int  # blocks it put: filed in the index, two commands each
    num_evicted: int  # blocks its puts evicted: unfiled, one command each
    nodes_read: int  # nodes its hits were read from


class PoolModel:
    """`n` nodes of `per_node` blocks each; requests are served round robin."""

    def __init__(self, n: int, per_node: int, shared: bool = True) -> None:
        self.caches: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(n)]
        self.per_node = per_node
        self.shared = shared
        self._nodes = {str(k): per_node for k in range(n)}
        self._num_served = 0

    def serve(self, hash_ids: Sequence[int]) -> Served:
        keys = [h.to_bytes(8, "big", signed=True) * 4 for h in hash_ids]
        home = self._num_served % len(self.caches)
        self._num_served += 1
        own = self.caches[home]
        local = next((i for i, key in enumerate(keys) if key not in own), len(keys))
        looked_up = self.shared and local < len(keys)
        holders = self.caches if self.shared else [own]
        num_hit, read_from = 0, set()
        for key in keys:
            node = next((k for k, c in enumerate(holders) if key in c), None)
            if node is None:
                break
            holders[node].move_to_end(key)
            read_from.add(node)
            num_hit += 1
        groups = len({(local + i) // CHAIN_GROUP_BLOCKS for i in range(len(keys) - local)})
        num_evicted = self._store(keys, num_hit, home)
        return Served(
            num_hit,
            looked_up,
            groups if looked_up else 0,
            len(keys) - num_hit,
            num_evicted,
            len(read_from),
        )

    def _store(self, keys: list[bytes], start: int, home: int) -> int:
        """Puts `keys[start:]` (placed, or at `home` without the pool); returns how many
        blocks that evicted."""
        new = keys[start:]
        if not new:
            return 0
        pieces = (
            placement.place(new, ChainPosition.of(keys, start), self._nodes, str(home))
            if self.shared
            else [placement.Piece(0, len(new), str(home), None)]
        )
        num_evicted = 0
        for piece in pieces:
            cache = self.caches[int(piece.address)]
            for key in new[piece.start : piece.stop]:
                cache[key] = None
                if len(cache) > self.per_node:
                    cache.popitem(last=False)
                    num_evicted += 1
        return num_evicted
