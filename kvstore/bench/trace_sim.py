"""Cache simulations over a trace, in blocks: reference LRU, offline optimum, any policy.

Each returns `num_hit`: per request, how many blocks from the first it hit (prefix semantics:
block i counts only if blocks 0..i-1 hit). `kvstore.bench.trace_file.hit_ratio` weighs them.

The reference LRU and Belady reproduce the table in traces/README.md to 3 decimals (with the
"blocks" weighting): every block of a request is accessed in chain order (a hit moves it to
the most recent end, a miss inserts it and evicts the least recent when over capacity), and
Belady evicts the block used again furthest in the future, deeper blocks first on ties, and
does not admit a block that would itself be that victim.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.bench.trace_file import TraceLine
from kvstore.store.eviction import EvictionPolicy, make_policy

NEVER = math.inf


def prefix_len(ids: Sequence[int], present: object) -> int:
    """How many of `ids`, from the first, are `in present`."""
    k = 0
    while k < len(ids) and ids[k] in present:  # type: ignore[operator]
        k += 1
    return k


def simulate_unbounded(requests: Sequence[TraceLine]) -> list[int]:
    """Infinite cache: a block hits from its second use on."""
    seen: set[int] = set()
    num_hit = []
    for req in requests:
        num_hit.append(prefix_len(req.hash_ids, seen))
        seen.update(req.hash_ids)
    return num_hit


def simulate_lru(requests: Sequence[TraceLine], capacity: int) -> list[int]:
    """The reference LRU of traces/README.md: blocks accessed one by one in chain order."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recent first
    num_hit = []
    for req in requests:
        num_hit.append(prefix_len(req.hash_ids, cache))
        for h in req.hash_ids:
            if h in cache:
                cache.move_to_end(h)
                continue
            cache[h] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return num_hit


def next_uses(requests: Sequence[TraceLine]) -> list[list[float]]:
    """`out[i][d]`: index of the next request after i that holds block d of request i."""
    out: list[list[float]] = [[] for _ in requests]
    upcoming: dict[int, float] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        out[i] = [upcoming.get(h, NEVER) for h in ids]
        upcoming.update(dict.fromkeys(ids, i))
    return out


class _Belady:
    """Blocks keyed by (next use, depth); the largest is the victim. Lazy-deleted max-heap."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rank: dict[int, tuple[float, int]] = {}  # block -> (next use, depth)
        self._heap: list[tuple[float, int, int]] = []  # (-next use, -depth, block)

    def put(self, block: int, rank: tuple[float, int]) -> None:
        self.rank[block] = rank
        heapq.heappush(self._heap, (-rank[0], -rank[1], block))

    def victim(self) -> tuple[int, tuple[float, int]]:
        while True:
            neg_next, neg_depth, block = self._heap[0]
            if self.rank.get(block) == (-neg_next, -neg_depth):
                return block, (-neg_next, -neg_depth)
            heapq.heappop(self._heap)  # stale: the block was re-ranked or evicted

    def access(self, block: int, rank: tuple[float, int]) -> None:
        if block not in self.rank and len(self.rank) >= self.capacity:
            victim, victim_rank = self.victim()
            if victim_rank <= rank:
                return  # the newcomer is the worst block: do not admit it
            del self.rank[victim]
        self.put(block, rank)


def simulate_belady(requests: Sequence[TraceLine], capacity: int) -> list[int]:
    """Offline optimum with prefix semantics; deeper blocks are evicted first on ties.

    A child is never used again before its parent (every request holding it holds the
    parent), so evicting the furthest next use takes chain tails first.
    """
    cache = _Belady(capacity)
    num_hit = []
    for req, nexts in zip(requests, next_uses(requests), strict=True):
        num_hit.append(prefix_len(req.hash_ids, cache.rank))
        for depth, (h, nxt) in enumerate(zip(req.hash_ids, nexts, strict=True)):
            cache.access(h, (nxt, depth))
    return num_hit


def simulate_policy(requests: Sequence[TraceLine], capacity: int, policy: str) -> list[int]:
    """A registry policy driven exactly as `Store` drives it during a trace replay
    (`simulate_instance` on a fresh `make_policy(policy)`)."""
    return simulate_instance(requests, capacity, make_policy(policy))


def simulate_instance(
    requests: Sequence[TraceLine], capacity: int, pol: EvictionPolicy
) -> list[int]:
    """`pol`, empty, driven exactly as `Store` drives its policy during a trace replay.

    Per request: match; touch the hits (acquire); touch the present parents of the rest
    (reserve); evict the first candidate until the misses fit; insert the misses in chain
    order (commit). Nothing is leased or reserved while evicting, so every candidate is
    evictable and the outcome equals a DRAM-only `Store` replay block for block.
    """
    assert not len(pol), "the policy must start empty"
    present: set[int] = set()
    num_hit = []
    for req in requests:
        k = prefix_len(req.hash_ids, present)
        num_hit.append(k)
        _replay_request(pol, present, req.hash_ids, k, capacity)
    return num_hit


def _replay_request(
    pol: EvictionPolicy, present: set[int], ids: Sequence[int], k: int, capacity: int
) -> None:
    # Hash ids stand in for keys: a policy only hashes and compares them.
    keys: Sequence = ids
    if k:
        pol.touch(keys[:k])
    if k == len(ids):
        return
    parents = [None, *keys[:-1]][k:]
    pol.touch([p for p in parents if p is not None])
    missing = [(h, p) for h, p in zip(keys[k:], parents, strict=True) if h not in present]
    for _ in range(len(present) + len(missing) - capacity):
        victim = next(iter(pol.candidates()))
        pol.remove(victim)
        present.discard(victim)
    for h, p in missing:
        pol.insert(h, p)
        present.add(h)
