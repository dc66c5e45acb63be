"""What the tests of single-node store semantics share (`test_store_puts.py`,
`test_store_in_place_writes.py`, `test_store_reads.py`, `test_store_eviction.py`): a small
DRAM-only store on an injected clock with `NS` registered, key chains, each key's payload,
and a whole put."""

from __future__ import annotations

from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig

NS = Namespace("test-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
OTHER_NS = Namespace("other-model", KVLayout("float16", 2, 1, 8, 4))
BLOCK = NS.block_bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(num_blocks: int = 16, policy: str = "prefix-lru", **kw) -> Store:
    """A store of `num_blocks` DRAM blocks of `NS` (registered), on a `FakeClock`."""
    config = StoreConfig(dram_bytes=num_blocks * BLOCK, slab_bytes=4 * BLOCK, policy=policy, **kw)
    store = Store(config, clock=FakeClock())
    store.register_namespace(NS)
    return store


def chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def put(store: Store, keys: list[bytes], parent: bytes | None = None) -> None:
    """Puts `keys` as one chain below `parent`, writing only the blocks reserved."""
    res = store.reserve(NS.id, keys, [parent, *keys[:-1]])
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            res.write(i, 0, payload(keys[i]))
    res.commit()
    store.check_integrity()
