"""A bounded LRU set of block ids, with prefix matching."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LRUBlockCache:
    """Block ids, least recently used evicted first past `capacity_blocks`."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0: {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recent first

    def prefix(self, hash_ids: Sequence[int], start: int = 0) -> int:
        """How many of ``hash_ids[start:]``, from the first, are held; changes nothing."""
        k = start
        while k < len(hash_ids) and hash_ids[k] in self._blocks:
            k += 1
        return k - start

    def insert(self, hash_ids: Sequence[int]) -> None:
        """Holds `hash_ids` as the most recently used, evicting the least recent past capacity.

        A chain is inserted tail first so that its root ends most recent: evicting from the
        LRU end takes tails before the prefixes they hang from.
        """
        for h in reversed(hash_ids):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks
