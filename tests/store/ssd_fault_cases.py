"""What the tests of SSD writes that fail share (`test_store_ssd_inline_failures.py`,
`test_store_ssd_demotion_failures.py`, `test_store_ssd_full_disk.py`): `Faults`, which the
`faults` fixture (conftest.py) puts in place of `SsdTier.write` to make it fail on demand, a
store with an SSD tier and `NS` registered, puts, and each key's tier and the store's
counts, to compare with the exact states a failure must leave."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store import Store, StoreConfig
from kvstore.store.tiers.base import Record

NS = Namespace("ssd-errors-model", KVLayout("float16", 2, 2, 16, 8))  # 1 KiB blocks
BLOCK = NS.block_bytes
INLINE_ONLY = {"dram_high_watermark": 1.0, "dram_low_watermark": 1.0}  # no demotion pass
ENOSPC = "mdb_txn_commit: No space left on device"

Writes = Callable[[Sequence[Record], Sequence[bytes]], object]  # (records, delete) -> ...


@dataclass
class Faults:
    """What `SsdTier.write` does here: runs `before(records, delete)`, then raises
    `lmdb.DiskError` if `should_fail(records, delete)`, else writes. Counts its calls."""

    should_fail: Writes = lambda records, delete: False
    before: Writes = lambda records, delete: None
    num_calls: int = 0

    def fail_all(self) -> None:
        self.should_fail = lambda records, delete: True

    def heal(self) -> None:
        self.should_fail = lambda records, delete: False


def make_store(path: Path, dram_blocks: int = 8, ssd_blocks: int = 32, **kw) -> Store:
    """LRU on both tiers and no background demotion, unless `kw` says otherwise."""
    settings = {"policy": "lru", "ssd_policy": "lru", "background_demotion": False, **kw}
    config = StoreConfig(
        dram_bytes=dram_blocks * BLOCK,
        slab_bytes=4 * BLOCK,
        ssd_path=str(path),
        ssd_bytes=ssd_blocks * BLOCK,
        **settings,
    )
    store = Store(config)
    store.register_namespace(NS)
    return store


def chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key)))[:BLOCK]


def put(store: Store, keys: list[bytes]) -> None:
    put_unchecked(store, keys)
    store.check_integrity()


def put_unchecked(store: Store, keys: list[bytes]) -> None:
    """A put that may wake the background demoter: check integrity once it has settled."""
    res = store.reserve(NS.id, keys, [None, *keys[:-1]])
    for i, key in enumerate(keys):
        res.write(i, 0, payload(key))
    res.commit()


def fastest_tiers(store: Store, keys: list[bytes]) -> tuple[str | None, ...]:
    """Each key's fastest tier, None for a miss."""
    matches = [store.match(NS.id, [key]) for key in keys]
    return tuple(m.tiers[0] if m.num_matched else None for m in matches)


class Counts(NamedTuple):
    dram: int  # blocks
    ssd: int  # blocks
    evictions: int
    drops: int
    demotions: int
    failures: int  # SSD writes that failed
    leases: int = 0
    reservations: int = 0


def counts(store: Store) -> Counts:
    stats = store.stats()
    tiers = {t.name: t.num_blocks for t in stats.tiers}
    return Counts(
        tiers["dram"],
        tiers["ssd"],
        stats.evictions,
        stats.drops,
        stats.demotions,
        stats.ssd_write_failures,
        stats.num_leases,
        stats.num_reservations,
    )


def writes_record_of(key: bytes) -> Writes:
    """Whether a write puts `key`'s record."""
    return lambda records, delete: any(r.key == NS.id + key for r in records)
