"""SSD tier on LMDB: one record per block, header + bytes, written in batched transactions.

The store keys records by block id (namespace id + key, 64 bytes); the header repeats the
namespace. Records of the older format, keyed by the 32-byte key alone, are re-keyed once
at start-up (`rekey`, one transaction).

Durability: each `write` is one LMDB transaction, so a crash never leaves half a batch.
With `sync=True` a committed transaction survives power loss; with `sync=False` (the
default, ~3x faster) it survives a process crash (the OS still holds the pages) but the
last transactions may be lost if the machine goes down. Every block carries the CRC32C of
its bytes in its header; readers verify it, so a damaged record is a miss, never bytes.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence

import lmdb

from kvstore import failpoints
from kvstore.store.tiers.base import PersistentTier, Record, RecordHeader, TierStats

log = logging.getLogger("kvstore.tiers.ssd")

_MAGIC = b"KVB2"  # 2: CRC32C checksums (1 had zlib CRC32)
_HEADER = struct.Struct("<4sB32s32sIQQ")  # magic, flags, namespace, parent, crc, nbytes, seq
_HAS_PARENT = 1
_MAP_HEADROOM = 64 << 20  # B-tree pages and free-page slack beyond the payload bytes


def encode_header(header: RecordHeader) -> bytes:
    flags = _HAS_PARENT if header.parent is not None else 0
    parent = header.parent or bytes(32)
    return _HEADER.pack(
        _MAGIC, flags, header.namespace_id, parent, header.checksum, header.nbytes, header.seq
    )


def decode_header(value: memoryview | bytes) -> RecordHeader | None:
    """The header of a stored value; None unless it is well formed and sized."""
    if len(value) < _HEADER.size:
        return None
    magic, flags, ns, parent, crc, nbytes, seq = _HEADER.unpack(bytes(value[: _HEADER.size]))
    if magic != _MAGIC or len(value) != _HEADER.size + nbytes:
        return None
    return RecordHeader(ns, parent if flags & _HAS_PARENT else None, crc, nbytes, seq)


class SsdTier(PersistentTier):
    """Blocks in an LMDB environment under `path`, at most `capacity_bytes` of payload.

    The store enforces the capacity (it evicts before it writes); the tier only counts.
    """

    name = "ssd"

    def __init__(self, path: str, capacity_bytes: int, sync: bool = False) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity_bytes = capacity_bytes
        self._env = lmdb.open(
            path,
            map_size=2 * capacity_bytes + _MAP_HEADROOM,
            max_dbs=2,
            sync=sync,
            metasync=sync,
            readahead=False,
        )
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._sizes: dict[bytes, int] = {}
        self._used_bytes = 0
        self._accounting = threading.Lock()  # writers may run outside the store's lock

    def can_fit(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity_bytes

    def stats(self) -> TierStats:
        with self._accounting:
            return TierStats(self.capacity_bytes, self._used_bytes, len(self._sizes))

    def write(self, records: Sequence[Record], delete: Sequence[bytes] = ()) -> None:
        """One transaction. Raises `lmdb.Error` (a full disk: `DiskError`, `MapFullError`)
        having changed nothing, on disk or in the usage counted here."""
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key in delete:
                txn.delete(key)
            for rec in records:
                txn.put(key=rec.key, value=encode_header(rec.header) + rec.payload)
            failpoints.hit("ssd_write_in_txn")
        with self._accounting:
            for key in delete:
                self._used_bytes -= self._sizes.pop(key, 0)
            for rec in records:
                self._used_bytes += rec.header.nbytes - self._sizes.get(rec.key, 0)
                self._sizes[rec.key] = rec.header.nbytes

    def rekey(self, moves: Sequence[tuple[bytes, bytes]], delete: Sequence[bytes] = ()) -> None:
        # Old and new copies coexist until the transaction commits: make room for both.
        with self._accounting:
            moved_bytes = sum(self._sizes.get(old, 0) + _HEADER.size for old, _ in moves)
        page_bytes = self._env.stat()["psize"]
        needed = moved_bytes + 2 * page_bytes * len(moves) + _MAP_HEADROOM
        self._env.set_mapsize(self._env.info()["map_size"] + needed)
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key in delete:
                txn.delete(key)
            for old, new in moves:
                value = txn.get(old)
                assert value is not None, "rekey of a record that is not there"
                txn.put(new, value)
                txn.delete(old)
        with self._accounting:
            for key in delete:
                self._used_bytes -= self._sizes.pop(key, 0)
            for old, new in moves:
                self._sizes[new] = self._sizes.pop(old)

    def read_into(self, key: bytes, dest: memoryview) -> RecordHeader | None:
        try:
            with self._env.begin(db=self._blocks, buffers=True) as txn:
                value = txn.get(key)
                header = None if value is None else decode_header(value)
                if value is None or header is None or header.nbytes != len(dest):
                    return None
                dest[:] = value[_HEADER.size :]
                return header
        except lmdb.Error as exc:
            log.error("event=ssd_read_failed key=%s error=%r", key.hex()[:16], exc)
            return None

    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None]]:
        """Every record; call once, right after opening: this is what counts usage.

        Stops at a damaged page, logging it: the records after it are lost, not misread.
        """
        try:
            with self._env.begin(db=self._blocks, buffers=True) as txn:
                for key, value in txn.cursor():
                    header = decode_header(value)
                    if header is not None:
                        self._sizes[bytes(key)] = header.nbytes
                        self._used_bytes += header.nbytes
                    yield bytes(key), header
        except lmdb.Error as exc:
            log.error("event=ssd_scan_failed error=%r", exc)

    def save_meta(self, name: bytes, value: bytes) -> None:
        with self._env.begin(write=True, db=self._meta) as txn:
            txn.put(name, value)

    def load_meta(self) -> dict[bytes, bytes]:
        with self._env.begin(db=self._meta) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    def close(self) -> None:
        self._env.close()
