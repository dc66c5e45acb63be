"""Replay a trace through a real in-process `Store`: match, read the hits, put the rest.

Per request: keys are blake2b of each hash id; `match` gives the hit prefix and its tiers;
`acquire` reads the hits (touching them in the policy); `reserve` the rest with their chain
predecessors as parents, and the reservation writes a small payload derived from each key
and commits. Demotion runs inline (no background thread), so a replay is deterministic.

Capacity is exact in blocks: DRAM holds `dram_blocks` slots of `block_bytes` (a multiple of
64, the slot alignment) in slabs of `k * block_bytes`, `k` the largest divisor of
`dram_blocks` up to 1024; the SSD holds `ssd_blocks * block_bytes` payload bytes. Both
tiers evict exactly when full (watermarks at 1.0).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.bench.trace_file import TraceLine
from kvstore.keys import KVLayout, Namespace
from kvstore.results import PutStatus, StoreStats
from kvstore.store import Store, StoreConfig
from kvstore.store.eviction import POLICIES

SLOT_ALIGN = 64
MAX_BLOCKS_PER_SLAB = 1024


@dataclass(frozen=True)
class ReplayConfig:
    """Tier capacities in blocks, the policy of every tier, and the payload size."""

    dram_blocks: int
    ssd_blocks: int = 0
    policy: str = "prefix-lru"
    block_bytes: int = 64

    def __post_init__(self) -> None:
        if self.dram_blocks < 1 or self.ssd_blocks < 0:
            raise ValueError(f"need dram_blocks >= 1, ssd_blocks >= 0: {self}")
        if self.block_bytes < SLOT_ALIGN or self.block_bytes % SLOT_ALIGN:
            raise ValueError(f"block_bytes must be a multiple of {SLOT_ALIGN}: {self.block_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {sorted(POLICIES)}")

    @property
    def slab_blocks(self) -> int:
        """Blocks per slab: divides `dram_blocks`, so DRAM holds exactly that many."""
        top = min(self.dram_blocks, MAX_BLOCKS_PER_SLAB)
        return next(k for k in range(top, 0, -1) if self.dram_blocks % k == 0)

    def store_config(self, ssd_path: str) -> StoreConfig:
        ssd: dict[str, Any] = {
            "ssd_path": ssd_path,
            "ssd_bytes": self.ssd_blocks * self.block_bytes,
        }
        return StoreConfig(
            dram_bytes=self.dram_blocks * self.block_bytes,
            slab_bytes=self.slab_blocks * self.block_bytes,
            policy=self.policy,
            ssd_policy=self.policy,
            dram_high_watermark=1.0,
            dram_low_watermark=1.0,
            ssd_high_watermark=1.0,
            ssd_low_watermark=1.0,
            background_demotion=False,
            **(ssd if self.ssd_blocks else {}),
        )

    @property
    def namespace(self) -> Namespace:
        # One "token" per block and uint8 K/V: block_bytes = 2 * head_dim.
        return Namespace("trace-replay", KVLayout("uint8", 1, 1, self.block_bytes // 2, 1))


class ReplayResult(NamedTuple):
    num_hit: list[int]  # per request: blocks hit from the first
    tier_hits: dict[str, int]  # hit blocks by the tier `match` found them in
    stats: StoreStats
    seconds: float


def block_key(hash_id: int) -> bytes:
    """The 32-byte store key of a trace hash id (any int, negative or wide)."""
    return hashlib.blake2b(str(hash_id).encode(), digest_size=32).digest()


def _payload(key: bytes, block_bytes: int) -> bytes:
    return key * (block_bytes // len(key))


def _serve(store: Store, ns_id: bytes, keys: Sequence[bytes], block_bytes: int) -> list[str]:
    """One request through the store; returns the tier of each hit of its prefix."""
    match = store.match(ns_id, keys)
    k = match.num_matched
    if k:
        store.acquire(ns_id, keys[:k]).release()
    if k < len(keys):
        parents = [None, *keys[:-1]][k:]
        res = store.reserve(ns_id, keys[k:], parents)
        for i, status in enumerate(res.statuses):
            if status is PutStatus.RESERVED:
                res.write(i, 0, _payload(keys[k + i], block_bytes))
        res.commit()
    return list(match.tiers)


def replay(
    requests: Sequence[TraceLine],
    config: ReplayConfig,
    advance: Callable[[int], None] = lambda n: None,
) -> ReplayResult:
    """Replays `requests` through a fresh store built from `config`; `advance(1)` per request."""
    with tempfile.TemporaryDirectory(prefix="kvstore-trace-") as ssd_dir:
        store = Store(config.store_config(ssd_dir))
        try:
            return _replay(store, requests, config, advance)
        finally:
            store.close()


def _replay(
    store: Store,
    requests: Sequence[TraceLine],
    config: ReplayConfig,
    advance: Callable[[int], None],
) -> ReplayResult:
    ns_id = store.register_namespace(config.namespace).namespace_id
    tiers: Counter[str] = Counter()
    num_hit = []
    start = time.perf_counter()
    for req in requests:
        hit_tiers = _serve(store, ns_id, [block_key(h) for h in req.hash_ids], config.block_bytes)
        tiers.update(hit_tiers)
        num_hit.append(len(hit_tiers))
        advance(1)
    seconds = time.perf_counter() - start
    return ReplayResult(num_hit, dict(tiers), store.stats(), seconds)
