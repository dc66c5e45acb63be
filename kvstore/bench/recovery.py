"""Restart recovery: how long a store takes to rebuild its index from an SSD tier.

Fills an SSD tier with N block records (chains of 64, as a store writes them), then times
opening a `Store` on it, beside the floor measured on the same file in the same run: a bare
LMDB cursor scan that touches every record's header.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import lmdb

from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace
from kvstore.store import Store, StoreConfig
from kvstore.store.index import block_id
from kvstore.store.tiers.base import Record, RecordHeader
from kvstore.store.tiers.ssd import SsdTier

NS = Namespace("recovery-bench", KVLayout("float16", 2, 2, 32, 16))  # 8 KiB blocks
CHAIN_LEN = 64
BATCH = 1024


def _fill(path: str, num_blocks: int) -> float:
    """Writes `num_blocks` records; returns the seconds it took."""
    payload = bytes(range(256)) * (NS.block_bytes // 256)
    crc = checksum(payload)
    tier = SsdTier(path, num_blocks * NS.block_bytes * 2)
    tier.save_meta(NS.id, NS.encode())
    start = time.perf_counter()
    with progress_bar(f"writing {num_blocks} records", num_blocks) as advance:
        parent = None
        for first in range(0, num_blocks, BATCH):
            records = []
            for seq in range(first, min(first + BATCH, num_blocks)):
                key = hashlib.blake2b(seq.to_bytes(8, "little"), digest_size=32).digest()
                parent = None if seq % CHAIN_LEN == 0 else parent
                header = RecordHeader(NS.id, parent, crc, NS.block_bytes, seq + 1)
                records.append(Record(block_id(NS.id, key), header, payload))
                parent = key
            tier.write(records)
            advance(len(records))
    tier.close()
    return time.perf_counter() - start


def _scan_floor(path: str) -> float:
    start = time.perf_counter()
    env = lmdb.open(path, max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"blocks", create=False), buffers=True) as txn:
        for key, value in txn.cursor():
            bytes(key), bytes(value[:90])
    env.close()
    return time.perf_counter() - start


def _recover(path: str, num_blocks: int) -> tuple[float, int]:
    config = StoreConfig(
        dram_bytes=64 << 20,
        ssd_path=path,
        ssd_bytes=num_blocks * NS.block_bytes * 2,
        background_demotion=False,
    )
    start = time.perf_counter()
    store = Store(config)
    seconds = time.perf_counter() - start
    num_recovered = store.stats().num_blocks
    store.close()
    return seconds, num_recovered


def run(options: SuiteOptions) -> list[Row]:
    num_blocks = 10_000 if options.quick else 100_000
    with tempfile.TemporaryDirectory(prefix="kvstore-recovery-") as tmp:
        path = str(Path(tmp) / "ssd")
        write_s = _fill(path, num_blocks)
        floor_s = _scan_floor(path)
        recover_s, num_recovered = _recover(path, num_blocks)
    return [
        {
            "blocks": num_blocks,
            "block_bytes": NS.block_bytes,
            "recovered": num_recovered,
            "write_s": round(write_s, 3),
            "scan_floor_s": round(floor_s, 3),
            "recovery_s": round(recover_s, 3),
            "x_floor": round(recover_s / floor_s, 2),
            "blocks_per_s": round(num_recovered / recover_s),
        }
    ]
