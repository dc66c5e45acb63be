"""2Q over chain tails: a block earns protection by its second use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvstore.store.eviction.base import BlockHint, EvictionPolicy
from kvstore.store.eviction.chain_links import ChainLinks
from kvstore.store.eviction.ghost_list import GhostList


class Prefix2QPolicy(EvictionPolicy):
    """2Q over chain tails: a block earns protection by its second use.

    Three lists, every candidate a chain tail so prefixes stay reachable:

    - probation, oldest first: blocks used once (inserted, never hit since). Victims come
      from here first.
    - protected, least recent first: blocks hit at least once, or inserted again while the
      ghost list remembered them. While it holds more than `PROTECTED_SHARE` of the blocks,
      its least recent block is the first victim instead.
    - ghost: keys evicted, half as many as the policy tracks blocks (`ghost_factor`; keys,
      not bytes).

    So a burst of blocks used once (a scan of new prompts) cannot flush blocks that proved
    reusable, and a block whose reuse came after its eviction is admitted straight to
    protected the next time. A block's parent is refreshed after the block is inserted, so
    on probation a chain's tail goes before its prefix. `ghost_factor=0` switches the ghost
    list off (for the ablation).

    The two sizes are the 2Q paper's (Johnson and Shasha, VLDB 1994: probation 25% of the
    slots, ghost list 50%). A ghost list much longer than that protects blocks that come
    back after long absences, which crowd out blocks reused sooner: at 1.5x and 2x the
    blocks, 2Q loses 2% to prefix-lru on a half of the shared trace (`kvstore-bench trace
    --ablation`); from 0.5x to 1.25x it does not.

    Invariants (`check`): every tracked key is on exactly one of probation and protected,
    and the ghost list holds no tracked key.
    """

    PROTECTED_SHARE = 0.75

    def __init__(self, ghost_factor: float = 0.5) -> None:
        self._ghost_factor = ghost_factor
        self._probation: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self._ghost = GhostList()
        self._chains = ChainLinks()

    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        self._chains.link(key, parent)
        (self._protected if self._ghost.pop(key) else self._probation)[key] = None
        if parent is not None:
            self._refresh(parent)  # the parent after its child, so the tail goes first

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # tail first: the root ends up the most recent
            if self._probation.pop(key, 0) is None:
                self._protected[key] = None
            elif key in self._protected:
                self._protected.move_to_end(key)

    def remove(self, key: bytes) -> None:
        if key not in self._chains:
            return
        self._chains.unlink(key)
        if self._probation.pop(key, 0) is not None:
            del self._protected[key]
        self._ghost.add(key, self._ghost_factor * len(self))

    def candidates(self) -> Iterator[bytes]:
        first, then = self._probation, self._protected
        if len(self._protected) > self.PROTECTED_SHARE * len(self):
            first, then = then, first
        tails = self._chains.is_tail
        yield from (k for k in first if tails(k))
        yield from (k for k in then if tails(k))

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def check(self) -> None:
        self._chains.check()
        tracked = self._chains.keys()
        assert not self._probation.keys() & self._protected.keys(), "on probation and protected"
        assert self._probation.keys() | self._protected.keys() == tracked, "lists and links"
        assert not any(k in self._ghost for k in tracked), "a tracked key in the ghost list"

    def _refresh(self, key: bytes) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:  # it waits from now, after its child
            self._probation.move_to_end(key)
