"""10,000 blocks of 256 KiB through a real server whose DRAM holds half of them."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys

NS = Namespace("llama-256k", KVLayout("float16", 4, 8, 128, 16))  # 256 KiB blocks
NUM_BLOCKS = 10_000
CHAIN_LEN = 64
CAPACITY_BLOCKS = NUM_BLOCKS // 2


def _expected(key: bytes) -> np.ndarray:
    """Block bytes derived from the key, so any misplaced or stale block shows up."""
    return np.tile(np.frombuffer(key, dtype=np.uint8), NS.block_bytes // len(key))


def _chains() -> list[list[bytes]]:
    chains, total, seed = [], 0, 0
    while total < NUM_BLOCKS:
        n = min(CHAIN_LEN, NUM_BLOCKS - total)
        tokens = np.arange(n * NS.block_tokens, dtype=np.uint32) + seed * 10_000_000
        chains.append(block_keys(NS, tokens))
        total, seed = total + n, seed + 1
    return chains


@pytest.mark.slow
def test_ten_thousand_blocks_with_half_capacity(store_factory):
    assert NS.block_bytes == 256 << 10
    capacity = CAPACITY_BLOCKS * NS.block_bytes
    store = store_factory("--dram-bytes", str(capacity), "--slab-bytes", "10MiB")
    chains = _chains()
    with Client(store.address, timeout_s=60.0) as client:
        client.register_namespace(NS)
        for keys in chains:
            stored = client.put_chain(NS.id, keys, [_expected(k) for k in keys])
            assert stored.num_stored == len(keys)
        num_found = 0
        for keys in chains:
            got = client.get(NS.id, keys)
            for key, block in zip(keys, got.blocks, strict=True):
                if block is not None:
                    assert np.array_equal(np.frombuffer(block, np.uint8), _expected(key))
                    num_found += 1
        stats = client.stats()
    assert stats.tiers[0].capacity_bytes == capacity
    assert stats.blocks_committed == NUM_BLOCKS
    assert stats.num_blocks == CAPACITY_BLOCKS
    assert stats.evictions == NUM_BLOCKS - CAPACITY_BLOCKS
    assert num_found == CAPACITY_BLOCKS
    assert stats.hits == CAPACITY_BLOCKS and stats.misses == NUM_BLOCKS - CAPACITY_BLOCKS
