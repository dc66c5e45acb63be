"""LRU over chain tails only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.store.eviction.base import BlockHint
from kvstore.store.eviction.chain_links import ChainLinks
from kvstore.store.eviction.lru import LRUPolicy


class PrefixLRUPolicy(LRUPolicy):
    """LRU over chain tails only: a block is a candidate once none of its children is stored.

    Evicting a parent makes every descendant unreachable by prefix match, so tails go
    first. A hit touches the chain tail-first, leaving the root the most recent, so the
    LRU order itself already favours tails and the tail filter rarely skips anything.
    """

    def __init__(self) -> None:
        super().__init__()
        self._chains = ChainLinks()

    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        super().insert(key, parent, moved)
        self._chains.link(key, parent)
        if parent is not None and parent in self._chains:
            self.touch([parent])

    def touch(self, keys: Sequence[bytes]) -> None:
        super().touch(list(reversed(keys)))

    def remove(self, key: bytes) -> None:
        if key in self._chains:
            super().remove(key)
            self._chains.unlink(key)

    def candidates(self) -> Iterator[bytes]:
        return (key for key in self._order if self._chains.is_tail(key))

    def check(self) -> None:
        """The LRU order and the chain links track the same keys; links agree both ways."""
        self._chains.check()
        assert self._chains.keys() == set(self._order), "LRU order and chain links disagree"
