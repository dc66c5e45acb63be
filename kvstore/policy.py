"""Eviction policies: which committed block to give up first. One registry, `POLICIES`.

A policy sees keys and chain links only, never bytes, tiers or leases. The store offers it
every committed block, reports accesses, and asks for candidates in eviction order; the
store itself skips candidates it may not evict (leased, reserved, in another tier).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import NamedTuple


class BlockHint(NamedTuple):
    """What a tier's policy knew of a block it gives up to the tier below, for that tier's
    policy (`EvictionPolicy.hint`, then `insert(..., hint=...)`)."""

    prompt_class: int  # an unread block's `prompt_class` of the prompt that wrote it


class EvictionPolicy(ABC):
    """Orders blocks for eviction.

    Contract: `insert` is called once per committed key, `remove` once when it leaves the
    store (evicted or removed), `touch` on every hit. `candidates` must not be advanced after
    the policy is mutated; the store takes one victim, evicts it, then asks again.
    """

    @abstractmethod
    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        """Starts tracking `key`, whose chain predecessor is `parent` (None for a root).

        `moved`: the block comes from another tier, so it is not new to the store: demoted
        from the tier above, which judged it worth keeping (`should_demote`), promoted from
        the tier below or copied up after a read, or recovered from disk. `hint`: what the
        tier above's policy knew of a demoted block (`hint`), if anything.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Records a hit on `keys`, given in chain order (root first)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Stops tracking `key`; a no-op for unknown keys."""

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Tracked keys, best victim first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def should_demote(self, key: bytes) -> bool:
        """Whether a victim of this (upper) tier is worth a write to the tier below.

        The tiered decision: True demotes the block, False drops it. Called with the key
        still tracked, just before the store evicts it.
        """
        return True

    def hint(self, key: bytes) -> BlockHint | None:
        """What this (upper) tier knows of `key` that the tier below's policy can use when
        the block is demoted; called with the key still tracked."""
        return None


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


class _Chains:
    """Parent/child links among tracked keys; a key none of whose children is stored is a tail.

    Keys may arrive children first (a lower tier receives a chain's victims tail first): a
    child whose parent is not tracked waits for it, and is linked when the parent arrives.
    """

    def __init__(self) -> None:
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._awaited: dict[bytes, set[bytes]] = {}  # untracked parent -> tracked children
        self._awaits: dict[bytes, bytes] = {}  # tracked child -> its untracked parent

    def link(self, key: bytes, parent: bytes | None) -> None:
        self._children.setdefault(key, set())
        if parent is not None and parent in self._children:
            self._parent[key] = parent
            self._children[parent].add(key)
        elif parent is not None:
            self._wait(key, parent)
        for child in self._awaited.pop(key, ()):
            del self._awaits[child]
            self._parent[child] = key
            self._children[key].add(child)

    def unlink(self, key: bytes) -> None:
        # Children of a removed key are unreachable by prefix; they become roots here, and
        # wait for the key in case it comes back.
        for child in self._children.pop(key):
            del self._parent[child]
            self._wait(child, key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._children[parent].discard(key)
        awaited = self._awaits.pop(key, None)
        if awaited is not None:
            self._awaited[awaited].discard(key)
            if not self._awaited[awaited]:
                del self._awaited[awaited]

    def _wait(self, child: bytes, parent: bytes) -> None:
        self._awaits[child] = parent
        self._awaited.setdefault(parent, set()).add(child)

    def __contains__(self, key: bytes) -> bool:
        return key in self._children

    def is_tail(self, key: bytes) -> bool:
        return not self._children[key]

    def children(self, key: bytes) -> set[bytes]:
        return self._children[key]

    def parent(self, key: bytes) -> bytes | None:
        return self._parent.get(key)


class PrefixLRUPolicy(LRUPolicy):
    """LRU over chain tails only: a block is a candidate once none of its children is stored.

    Evicting a parent makes every descendant unreachable by prefix match, so tails go
    first. A hit touches the chain tail-first, leaving the root the most recent, so the
    LRU order itself already favours tails and the tail filter rarely skips anything.
    """

    def __init__(self) -> None:
        super().__init__()
        self._chains = _Chains()

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


class _ReturnRates:
    """How often unread blocks come back, by their distance to the end of their chain.

    A block *comes back* when it is read, or inserted again while its key is in the ghost
    list; it is *gone* when it was evicted and has not. Counts are halved after every
    `len(policy)` outcomes (at least `MIN_WINDOW`), so the rates follow the workload.
    """

    MIN_WINDOW = 64

    def __init__(self, num_distances: int) -> None:
        self._back = [0.0] * num_distances
        self._gone = [0.0] * num_distances
        self._since_halving = 0

    def record(self, distance: int, came_back: bool, halve_after: int) -> None:
        (self._back if came_back else self._gone)[distance] += 1
        self._since_halving += 1
        if self._since_halving > max(halve_after, self.MIN_WINDOW):
            self._since_halving = 0
            self._back = [n / 2 for n in self._back]
            self._gone = [n / 2 for n in self._gone]

    def came_back_after_all(self, distance: int) -> None:
        self._gone[distance] -= 1
        self._back[distance] += 1

    def rate(self, distance: int) -> float:
        """The share that came back, with a uniform prior (0.5 before any outcome)."""
        back, gone = self._back[distance], self._gone[distance]
        return (back + 1) / (back + max(gone, 0.0) + 2)


class _Ghost(NamedTuple):
    distance: int | None  # an unread block's distance to its chain's end, else None
    prompt_class: int | None  # an unread block's prompt class, else None
    was_read: bool  # a second chance (read, then overflowed protected), not a new block
    evicted_at: int  # the ghost list's eviction count when it was evicted


class _GhostList:
    """Keys evicted from probation, oldest first: ARC's two ghost lists in one.

    Each entry says whether its block had been read (ARC's B2) or not (B1); `counts` gives
    how many of each the list holds.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, _Ghost] = OrderedDict()
        self.counts = [0, 0]  # unread, read
        self._evictions = 0

    def add(
        self,
        key: bytes,
        distance: int | None,
        prompt_class: int | None,
        was_read: bool,
        limit: float,
    ) -> None:
        """Remembers an evicted key, then forgets the oldest beyond `limit` entries."""
        self._evictions += 1
        self._entries[key] = _Ghost(distance, prompt_class, was_read, self._evictions)
        self.counts[was_read] += 1
        while len(self._entries) > limit:
            _, ghost = self._entries.popitem(last=False)
            self.counts[ghost.was_read] -= 1

    def pop(self, key: bytes) -> tuple[_Ghost, int] | None:
        """Forgets `key`; its entry and how many evictions came after it, if remembered."""
        ghost = self._entries.pop(key, None)
        if ghost is None:
            return None
        self.counts[ghost.was_read] -= 1
        return ghost, self._evictions - ghost.evicted_at

    def __len__(self) -> int:
        return len(self._entries)


class Mechanism(enum.Enum):
    """A part of `Prefix2QPolicy` that can be switched off, to measure what it gains."""

    SECOND_CHANCES = "second-chances"
    ADAPTIVE_SHARE = "adaptive-share"
    NEAR_ENDS = "near-ends"
    PROMPT_CLASSES = "prompt-classes"


ALL_MECHANISMS = frozenset(Mechanism)


def prompt_class(num_blocks: int) -> int:
    """The class of a prompt of `num_blocks` blocks: 0 below 4, then one per doubling (4 to
    7, 8 to 15, ...), the last from 64 on."""
    return max(0, min(num_blocks.bit_length() - 2, Prefix2QPolicy.PROMPT_CLASSES - 1))


class Prefix2QPolicy(EvictionPolicy):
    """2Q over chain tails: a block earns protection by its second use.

    Three lists, every candidate a chain tail so prefixes stay reachable:

    - probation: blocks used once (inserted, never hit since), and blocks that overflowed
      protected (a second chance). Victims come from here: the *near ends* first, then the
      block that has waited longest, where a block of a *prompt class* that comes back less
      often waits faster (below).
    - protected, least recent first: blocks hit at least once, or inserted again soon after
      they were evicted from probation (the ghost list remembers those keys, not bytes).
      When it holds more than its share of the blocks, its least recent block moves to the
      young end of probation, as in segmented LRU, so a reused block that went cold still
      outlives the blocks used once before it.
    - ghost: keys evicted from probation, the most recent `GHOST_FACTOR * len(self)`.

    So a burst of blocks used once (a scan of new prompts) cannot flush blocks that proved
    reusable, and a block whose reuse came after its eviction is admitted straight to
    protected the next time.

    The shares adapt as in ARC. Probation starts at `PROBATION_FRACTION` of the blocks. A
    block evicted unread and asked for again within as many evictions as protected holds
    would have hit with a longer probation, so probation grows by one block (more when
    fewer such keys are remembered than read ones); a second chance asked for again within
    as many evictions as probation holds would have hit with a larger protected, so
    probation shrinks. Conversations, whose next turn comes a while later, want a long
    probation; prompts over shared documents, reused at random, want protected large.

    Unread blocks fall into classes, and the policy counts, per class, how many of them came
    back (were read, or inserted again while remembered in the ghost list) and how many were
    evicted for good (`_ReturnRates`). Two kinds of class:

    - Near ends. Prompts that share a prefix part where they diverge, so the last blocks of
      a prompt are often its own: the question after a shared document, the partial block a
      conversation's next turn rewrites. Whether they are depends on the workload: a chat
      turn's next-to-last blocks are read by its next turn. Each unread block has a distance
      to the end of its chain (0 for a tail; blocks below it unread too), one class per
      distance below `NEAR_END_BLOCKS` and one for all farther blocks. A distance whose
      blocks come back less than `NEAR_END_RETURN` times as often as farther ones makes its
      blocks near ends: they go first, the closest to the end first, and a chain's very end
      (distance 0, a *dead end*) is not worth a demotion.
    - Prompt classes. Whether a prompt is asked for again depends on what it is: a long
      document is shared more than a one-line question, or the other way round. An unread
      block's prompt length is the depth, in blocks from its root, of the deepest unread
      block below it (the prompt that wrote it), in `PROMPT_CLASSES` classes
      (`prompt_class`). A block's time on probation counts `(best / rate) ** 2` times, where
      `rate` is how often its class comes back and `best` the rate of the class that comes
      back most (blocks of no class count as the best). So a class that comes back a tenth
      as often goes almost at once, one that comes back half as often waits a quarter as
      long, and classes that come back about as often (a conversation's turns, however
      long) keep their order of arrival.

    Only blocks new to the store have a distance and a prompt class of their own: a tier
    below sees a chain's blocks tail first, from a tier that judged them worth keeping, so
    a block that moved between tiers is never a near end; a demoted unread block keeps the
    prompt class the tier above gave it (`hint`).
    """

    PROBATION_FRACTION = 0.25
    MIN_PROBATION, MAX_PROBATION = 0.05, 0.95
    GHOST_FACTOR = 2.0
    NEAR_END_BLOCKS = 3
    NEAR_END_RETURN = 0.75
    PROMPT_CLASSES = 6
    NO_CLASS = PROMPT_CLASSES  # the index of blocks of no prompt class in `_waiting`

    def __init__(self, mechanisms: Iterable[Mechanism] = ALL_MECHANISMS) -> None:
        self.mechanisms = frozenset(mechanisms)
        self._on = {m: m in self.mechanisms for m in Mechanism}
        self._clock = 0  # blocks inserted so far: probation's time
        self._probation: dict[bytes, int] = {}  # -> the clock when it entered probation
        self._second_chances: set[bytes] = set()  # read blocks on probation
        self._protected: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self._probation_share = self.PROBATION_FRACTION
        self._ghost = _GhostList()
        self._chains = _Chains()
        # Depth from the root, as far as this tier holds the chain.
        self._depth: dict[bytes, int] = {}
        # Unread blocks (a subset of probation) -> distance to their chain's end, at most
        # NEAR_END_BLOCKS ("farther"); and those nearer, by distance, oldest first.
        self._distance: dict[bytes, int] = {}
        self._near_ends = [OrderedDict[bytes, None]() for _ in range(self.NEAR_END_BLOCKS)]
        self._returns = _ReturnRates(self.NEAR_END_BLOCKS + 1)
        # Unread blocks (on probation) -> their prompt class. Probation by prompt class,
        # oldest first, then the blocks of no class (NO_CLASS).
        self._prompt_class: dict[bytes, int] = {}
        self._waiting = [OrderedDict[bytes, None]() for _ in range(self.PROMPT_CLASSES + 1)]
        self._prompt_returns = _ReturnRates(self.PROMPT_CLASSES)

    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        self._clock += 1
        self._chains.link(key, parent)
        self._depth[key] = self._depth[parent] + 1 if parent in self._depth else 0
        if (remembered := self._ghost.pop(key)) is not None:
            ghost, evictions_since = remembered
            if ghost.distance is not None:
                self._returns.came_back_after_all(ghost.distance)
            if ghost.prompt_class is not None:
                self._prompt_returns.came_back_after_all(ghost.prompt_class)
            self._adapt(ghost, evictions_since)
            self._protected[key] = None
        else:
            self._enter_probation(key)
            if not moved:
                if self._on[Mechanism.NEAR_ENDS]:
                    self._distance[key] = -1  # unread; its distance comes from its children
                    self._update_distance(key)
                if self._on[Mechanism.PROMPT_CLASSES]:
                    self._raise_prompt_class(key, prompt_class(self._depth[key] + 1))
            elif hint is not None and self._on[Mechanism.PROMPT_CLASSES]:
                self._raise_prompt_class(key, hint.prompt_class)
        if parent is not None:
            self._update_distance(parent)
            self._refresh(parent)  # the parent after its child, so the tail goes first
        self._balance()

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # tail first: the root ends up the most recent
            was_waiting = self._leave_probation(key)
            distance, klass = self._forget_unread(key)
            if distance is not None:
                self._returns.record(distance, True, len(self))
            if klass is not None:
                self._prompt_returns.record(klass, True, len(self))
            self._second_chances.discard(key)
            if was_waiting:
                self._protected[key] = None
            elif key in self._protected:
                self._protected.move_to_end(key)
        self._balance()

    def remove(self, key: bytes) -> None:
        if key not in self._chains:
            return
        self._chains.unlink(key)
        del self._depth[key]
        was_waiting = self._leave_probation(key)
        distance, klass = self._forget_unread(key)
        was_protected = self._protected.pop(key, 0) is None
        if was_protected and not self._on[Mechanism.SECOND_CHANCES]:
            self._ghost.add(key, None, None, True, self.GHOST_FACTOR * len(self))
        if was_waiting:
            if distance is not None:
                self._returns.record(distance, False, len(self))
            if klass is not None:
                self._prompt_returns.record(klass, False, len(self))
            was_read = key in self._second_chances
            self._second_chances.discard(key)
            self._ghost.add(key, distance, klass, was_read, self.GHOST_FACTOR * len(self))
        self._balance()

    def candidates(self) -> Iterator[bytes]:
        over = len(self._protected) > (1 - self._probation_share) * len(self)
        if over and not self._on[Mechanism.SECOND_CHANCES]:  # plain 2Q: protected's LRU
            yield from (k for k in self._protected if self._chains.is_tail(k))
        near = self.near_end_distances()
        for distance in near:
            yield from (k for k in self._near_ends[distance] if self._chains.is_tail(k))

        def waited(waiting: Iterable[bytes], speed: float) -> Iterator[tuple[float, bytes]]:
            for k in waiting:  # oldest first: longest waited first
                yield (self._clock - self._probation[k]) * speed, k

        speeds = self.waiting_speeds()
        queues = [waited(w, speed) for w, speed in zip(self._waiting, speeds, strict=True)]
        for _, k in heapq.merge(*queues, key=itemgetter(0), reverse=True):
            if self._distance.get(k) not in near and self._chains.is_tail(k):
                yield k
        if not (over and not self._on[Mechanism.SECOND_CHANCES]):
            yield from (k for k in self._protected if self._chains.is_tail(k))

    def should_demote(self, key: bytes) -> bool:
        """Demotes every block but a dead end, while dead ends rarely come back."""
        return self._distance.get(key) != 0 or 0 not in self.near_end_distances()

    def hint(self, key: bytes) -> BlockHint | None:
        """An unread block's prompt class, for the tier below."""
        klass = self._prompt_class.get(key)
        return None if klass is None else BlockHint(klass)

    def near_end_distances(self) -> list[int]:
        """Distances to a chain's end whose unread blocks now go first."""
        farther = self._returns.rate(self.NEAR_END_BLOCKS)
        return [
            d
            for d in range(self.NEAR_END_BLOCKS)
            if self._returns.rate(d) < self.NEAR_END_RETURN * farther
        ]

    def waiting_speeds(self) -> list[float]:
        """How fast a block's time on probation counts, per prompt class, then for blocks of
        no class: `(best / rate) ** 2`, at least 1."""
        rates = [self._prompt_returns.rate(c) for c in range(self.PROMPT_CLASSES)]
        best = max(rates)
        return [(best / rate) ** 2 for rate in rates] + [1.0]

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def _update_distance(self, key: bytes | None) -> None:
        """Re-derives the distance to the end of `key`, then of its ancestors, while it grows.

        0 for a tail, else one more than the farthest child, capped at NEAR_END_BLOCKS; a
        read child makes the block no longer unread-below, so it leaves the near ends
        (counted as farther). Distances never shrink: evicting a block leaves its parent
        where it was.
        """
        while key is not None and key in self._distance:
            children = self._chains.children(key)
            below = [self._distance[c] for c in children if c in self._distance]
            if len(below) < len(children):  # a read child
                distance = self.NEAR_END_BLOCKS
            else:
                distance = min(1 + max(below, default=-1), self.NEAR_END_BLOCKS)
            old = self._distance[key]
            if distance <= old:
                return
            if 0 <= old < self.NEAR_END_BLOCKS:
                del self._near_ends[old][key]
            self._distance[key] = distance
            if distance < self.NEAR_END_BLOCKS:
                self._near_ends[distance][key] = None
            key = self._chains.parent(key)

    def _raise_prompt_class(self, key: bytes | None, klass: int) -> None:
        """Gives `key`, on probation, the prompt class `klass`, and its unread ancestors too,
        while it is higher than theirs: a prompt is as long as its deepest unread block."""
        first = True
        while key is not None and (first or key in self._prompt_class):
            old = self._prompt_class.get(key, self.NO_CLASS)
            if old != self.NO_CLASS and old >= klass:
                return
            del self._waiting[old][key]
            self._prompt_class[key] = klass
            self._waiting[klass][key] = None
            key, first = self._chains.parent(key), False

    def _enter_probation(self, key: bytes) -> None:
        self._probation[key] = self._clock
        self._waiting[self.NO_CLASS][key] = None

    def _leave_probation(self, key: bytes) -> bool:
        """Takes `key` off probation; whether it was there."""
        if key not in self._probation:
            return False
        del self._probation[key]
        del self._waiting[self._prompt_class.get(key, self.NO_CLASS)][key]
        return True

    def _forget_unread(self, key: bytes) -> tuple[int | None, int | None]:
        """Forgets that `key` is unread; returns its distance and prompt class, if any."""
        distance = self._distance.pop(key, None)
        if distance is not None and 0 <= distance < self.NEAR_END_BLOCKS:
            del self._near_ends[distance][key]
        return distance, self._prompt_class.pop(key, None)

    def _adapt(self, ghost: _Ghost, evictions_since: int) -> None:
        """ARC's adaptation of the probation share, on a key back from the ghost list."""
        if not self._on[Mechanism.ADAPTIVE_SHARE]:
            return
        unread, read = (max(n, 1) for n in self._ghost.counts)
        step = 1 / max(len(self), 1)
        if not ghost.was_read and evictions_since < len(self._protected):
            share = self._probation_share + step * max(1, read / unread)
        elif ghost.was_read and evictions_since < len(self._probation):
            share = self._probation_share - step * max(1, unread / read)
        else:
            return  # back too late for any share to have kept it
        self._probation_share = min(max(share, self.MIN_PROBATION), self.MAX_PROBATION)

    def _balance(self) -> None:
        """Moves protected's least recent blocks beyond its share to probation's young end."""
        if not self._on[Mechanism.SECOND_CHANCES]:
            return
        while len(self._protected) > (1 - self._probation_share) * len(self):
            key, _ = self._protected.popitem(last=False)
            self._enter_probation(key)
            self._second_chances.add(key)

    def _refresh(self, key: bytes) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:  # it waits from now, after its child
            self._probation[key] = self._clock
            self._waiting[self._prompt_class.get(key, self.NO_CLASS)].move_to_end(key)


POLICIES: MappingProxyType[str, type[EvictionPolicy]] = MappingProxyType(
    {"lru": LRUPolicy, "prefix-lru": PrefixLRUPolicy, "prefix-2q": Prefix2QPolicy}
)


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by registry name; raises KeyError listing the known names."""
    if name not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
