"""2Q over chain tails: a block earns protection by its second use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvstore.store.eviction.base import BlockHint, EvictionPolicy
from kvstore.store.eviction.chain_links import ChainLinks
from kvstore.store.eviction.ghost_list import GhostList

GHOST_AGES = (0.5, 1.0, 2.0, 4.0)  # classes of ghost ages, in multiples of the tracked blocks


class Prefix2QPolicy(EvictionPolicy):
    """2Q over chain tails: a block earns protection by its second use.

    Three lists, every candidate a chain tail so prefixes stay reachable:

    - probation, oldest first: blocks used once (inserted, never hit since). Victims come
      from here first.
    - protected, least recent first: blocks hit at least once, or inserted again while the
      ghost list remembered them (below). While it holds more than `PROTECTED_SHARE` of
      the blocks, its least recent block is the first victim instead.
    - ghost: keys evicted, with their age (how many keys were evicted after them), up to
      the last of `ghost_ages` times as many as the policy tracks blocks (keys, not bytes).

    So a burst of blocks used once (a scan of new prompts) cannot flush blocks that proved
    reusable, and a block whose reuse came after its eviction can be admitted straight to
    protected the next time. A block's parent is refreshed after the block is inserted, so
    on probation a chain's tail goes before its prefix.

    How long the ghost list vouches for a block is earned, not fixed. A block back from
    within half the tracked blocks' worth of evictions (the first of `ghost_ages`, the 2Q
    paper's ghost list: Johnson and Shasha, VLDB 1994) is always protected. One back from
    an older age class is protected while the blocks protected from that class lately
    earned at least as many hits per block as protected blocks earn before they leave;
    one in `EXPLORE_EVERY` is protected anyway, so a class that stopped earning can earn
    again. The counts halve whenever `MEMORY_CACHES` times the tracked blocks were touched.
    Where protected blocks are reused soon (a cache that fits its working set), old
    returners would crowd them out and stay on probation; where reuse comes later than
    the cache can wait for (real conversation traffic: most blocks come back after some
    5,800 other new blocks), the blocks that come back at all are the best bet, and are
    kept. `kvstore-bench trace --ablation` measures both halves of the rule.

    `ghost_ages=(0.5,)` is plain 2Q with the paper's ghost list; `()` forgets what it
    evicts (for the ablation).

    Invariants (`check`): every tracked key is on exactly one of probation and protected,
    the ghost list holds no tracked key, and every block counted as back from the ghost
    list is protected.
    """

    PROTECTED_SHARE = 0.75
    EXPLORE_EVERY = 4
    MEMORY_CACHES = 4

    def __init__(self, ghost_ages: Sequence[float] = GHOST_AGES) -> None:
        self._ages = tuple(ghost_ages)
        self._probation: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self._ghost = GhostList()
        self._chains = ChainLinks()
        # What protection earns: hits per block, of blocks back from each ghost age class
        # (from when they came back until they leave), and of all protected blocks.
        self._back_from: dict[bytes, int] = {}  # protected block -> its ghost age class
        self._back_hits = [0.0] * len(self._ages)
        self._back_blocks = [1.0] * len(self._ages)  # a class starts as earning nothing
        self._protected_hits, self._protected_left = 0.0, 1.0
        self._num_returns = 0  # blocks back from past the first age class
        self._num_touched = 0  # keys touched since the counts last halved

    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        self._chains.link(key, parent)
        age = self._ghost.pop(key)
        age_class = None if age is None else self._age_class(age)
        if age_class is not None and self._protects(age_class):
            self._protected[key] = None
            self._back_from[key] = age_class
            self._back_blocks[age_class] += 1
        else:
            self._probation[key] = None
        if parent is not None:
            self._refresh(parent)  # the parent after its child, so the tail goes first

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # tail first: the root ends up the most recent
            if self._probation.pop(key, 0) is None:
                self._protected[key] = None
            elif key in self._protected:
                self._protected.move_to_end(key)
                self._protected_hits += 1
                age_class = self._back_from.get(key)
                if age_class is not None:
                    self._back_hits[age_class] += 1
        self._num_touched += len(keys)
        if self._num_touched > self.MEMORY_CACHES * max(len(self), 1):
            self._halve_counts()

    def remove(self, key: bytes) -> None:
        if key not in self._chains:
            return
        self._chains.unlink(key)
        if self._probation.pop(key, 0) is not None:
            del self._protected[key]
            self._protected_left += 1
            self._back_from.pop(key, None)
        self._ghost.add(key, max(self._ages, default=0.0) * len(self))

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
        assert self._back_from.keys() <= self._protected.keys(), "a returner off protected"

    def earnings(self) -> tuple[float, list[float]]:
        """Hits per block lately: of protected blocks, and of the blocks back from each
        ghost age class (what `insert` compares)."""
        per_class = [h / n for h, n in zip(self._back_hits, self._back_blocks, strict=True)]
        return self._protected_hits / self._protected_left, per_class

    def _age_class(self, age: int) -> int:
        """The first class of `ghost_ages` that `age` (in evicted keys) falls in; the last
        where the tracked blocks shrank since (the ghost list is bounded by the last)."""
        tracked = max(len(self), 1)
        return next(
            (i for i, a in enumerate(self._ages) if age <= a * tracked), len(self._ages) - 1
        )

    def _protects(self, age_class: int) -> bool:
        if age_class == 0:
            return True
        self._num_returns += 1
        if self._num_returns % self.EXPLORE_EVERY == 0:
            return True
        protected, per_class = self.earnings()
        return per_class[age_class] >= protected

    def _halve_counts(self) -> None:
        self._num_touched = 0
        self._back_hits = [h / 2 for h in self._back_hits]
        self._back_blocks = [n / 2 for n in self._back_blocks]
        self._protected_hits /= 2
        self._protected_left /= 2

    def _refresh(self, key: bytes) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:  # it waits from now, after its child
            self._probation.move_to_end(key)
