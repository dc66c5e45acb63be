"""`kvstore-bench trace --cost`: what each policy costs per operation with many blocks.

A policy of `num_blocks` blocks in chains of `CHAIN_BLOCKS` (a 12,800-token prompt at 512
tokens a block), filled by inserts in chain order; then touches of random chains' prefixes,
root first, as a read does; then victim choices, each the first candidate evicted and a
new block inserted in its place, as a full tier does on a put. Times are per operation
(per key for touches; a victim choice alone, and with its removal and the insert that
follows), one thread, the policy alone (no store around it).
"""

from __future__ import annotations

import random
import time

from kvstore.bench.report import Row
from kvstore.store.eviction import POLICIES, make_policy

CHAIN_BLOCKS = 25
NUM_BLOCKS = 320_000
QUICK_BLOCKS = 32_000
NUM_TOUCHES = 20_000  # chains touched
NUM_VICTIMS = 20_000


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def measure(name: str, num_blocks: int = NUM_BLOCKS, seed: int = 0) -> Row:
    """Microseconds per insert, touched key and victim choice of policy `name`."""
    rng = random.Random(seed)
    policy = make_policy(name)
    keys = [_key(i) for i in range(num_blocks + NUM_VICTIMS)]
    start = time.perf_counter()
    for i in range(num_blocks):
        policy.insert(keys[i], keys[i - 1] if i % CHAIN_BLOCKS else None)
    insert_s = time.perf_counter() - start

    chains = num_blocks // CHAIN_BLOCKS
    reads = []
    for _ in range(NUM_TOUCHES):
        root = rng.randrange(chains) * CHAIN_BLOCKS
        reads.append(keys[root : root + rng.randint(1, CHAIN_BLOCKS)])
    start = time.perf_counter()
    for read in reads:
        policy.touch(read)
    touch_s = time.perf_counter() - start

    choose_s = 0.0
    start = time.perf_counter()
    for i in range(num_blocks, num_blocks + NUM_VICTIMS):
        chosen = time.perf_counter()
        victim = next(iter(policy.candidates()))
        choose_s += time.perf_counter() - chosen
        policy.remove(victim)
        policy.insert(keys[i], None)
    evict_s = time.perf_counter() - start
    return {
        "policy": name,
        "blocks": num_blocks,
        "insert_us": insert_s / num_blocks * 1e6,
        "touch_us_per_key": touch_s / sum(len(r) for r in reads) * 1e6,
        "victim_us": choose_s / NUM_VICTIMS * 1e6,
        "evict_and_insert_us": evict_s / NUM_VICTIMS * 1e6,
    }


def run_cost(quick: bool) -> list[Row]:
    """One row per policy of the registry."""
    return [measure(name, QUICK_BLOCKS if quick else NUM_BLOCKS) for name in POLICIES]
