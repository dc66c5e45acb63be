"""Least recently used first, blind to chains."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvstore.store.eviction.base import BlockHint, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used first. Blind to chains: it may evict a root before its tail."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def check(self) -> None:
        """Nothing to break: one ordered set."""
