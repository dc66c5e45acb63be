"""SSD writes: the transactions that put blocks on SSD and delete their records, and what
memory does when one fails.

A write is one LMDB transaction (`SsdTier.write`): it puts `records` and deletes the SSD
copies given up to make room for them. One that fails (a full disk) changed nothing, so
memory is brought back to describe the disk: copies given up come back on SSD, records of
blocks removed meanwhile are deleted, and the blocks it was for stay off SSD.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import NamedTuple

import lmdb

from kvstore.store import chains
from kvstore.store.eviction import BlockHint
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.tiering.ssd_space import SsdSpace
from kvstore.store.tiering.usage import TieringCounters
from kvstore.store.tiers.base import Record, RecordHeader
from kvstore.store.tiers.dram import DramTier
from kvstore.store.tiers.ssd import SsdTier

log = logging.getLogger(__name__)


class Batch(NamedTuple):
    """One SSD transaction: `records` to put, and the SSD copies given up to make room for
    them, whose records it deletes."""

    records: list[Record]
    copies: list[Entry]  # of blocks still in DRAM, pinned until the write ends
    dropped: list[Entry]  # of blocks only on SSD, dropped from the index

    @property
    def delete(self) -> list[bytes]:
        return [e.block_id for e in self.copies + self.dropped]


class SsdWriter:
    """Runs SSD transactions. `prepare`, `end` and `finish` run under the store's lock
    `lock`; `run` may run without it (one writer at a time)."""

    def __init__(
        self,
        index: BlockIndex,
        lock: threading.RLock,
        dram: DramTier,
        space: SsdSpace,
        counters: TieringCounters,
    ) -> None:
        self.index = index
        self.lock = lock
        self.dram = dram
        self.space = space
        self.ssd: SsdTier = space.ssd
        self.counters = counters

    def prepare(self, entries: list[Entry]) -> Batch:
        """The transaction that writes `entries`, with the deletes that make room for them."""
        if not entries:
            return Batch([], [], [])
        by_tenant: dict[str, int] = {}
        for e in entries:
            tenant = self.space.tenant_of(e.namespace_id)
            by_tenant[tenant] = by_tenant.get(tenant, 0) + e.nbytes
        copies, dropped = self.space.make_room(sum(by_tenant.values()), by_tenant)
        records = []
        for e in entries:
            assert e.slot is not None
            header = RecordHeader(e.namespace_id, e.parent, e.checksum, e.nbytes, e.seq)
            records.append(Record(e.block_id, header, self.dram.view(e.slot)))
        return Batch(records, copies, dropped)

    def run(self, batch: Batch) -> bool:
        """Runs `batch`, with or without the store's lock held; False if it failed, which
        leaves SSD as it was."""
        if not batch.records:
            return True
        try:
            self.ssd.write(batch.records, batch.delete)
        except lmdb.Error as exc:
            with self.lock:
                self.record_failure(exc, len(batch.records))
            return False
        return True

    def end(self, batch: Batch, is_written: bool) -> None:
        """After `batch` ran, its copies unpinned by the caller: if it failed, their records
        are still there, so the blocks come back on SSD, and the records of those removed or
        put again meanwhile are deleted."""
        if is_written:
            return
        copies = [e for e in batch.copies if self.index.get(e.block_id) is e]
        dropped = [e for e in batch.dropped if self._can_take_back(e)]
        self._take_back(copies + dropped)
        self.counters.drops -= len(dropped)
        back = {id(e) for e in copies + dropped}
        self.delete_stale([e for e in batch.copies + batch.dropped if id(e) not in back])

    def finish(self, entries: list[Entry], hints: Mapping[bytes, BlockHint | None]) -> None:
        """Tracks written `entries` on SSD, with the DRAM policy's `hints` for them."""
        for entry in entries:
            self.space.track(entry, hints.get(entry.block_id), is_reused=entry.num_hits > 0)
            self.counters.tiers["ssd"].bytes_written += entry.nbytes
        self.counters.demotions += len(entries)

    def delete(self, entries: list[Entry]) -> bool:
        """Deletes the records of `entries`, in one transaction, under the lock; False if
        that failed (a full disk), which leaves SSD, and memory, as they were."""
        if not entries:
            return True
        try:
            self.ssd.write([], delete=[e.block_id for e in entries])
        except lmdb.Error as exc:
            self.record_failure(exc, len(entries))
            return False
        return True

    def delete_stale(self, entries: list[Entry]) -> None:
        """Deletes the records of `entries`, blocks removed (or put again) while a write
        held them, unless their id is on SSD now. If that fails too, those whose id is free
        come back as SSD blocks, so memory describes the disk; the record of an id put again
        meanwhile stays unaccounted."""
        stale = [e for e in entries if not self._is_on_ssd(e.block_id)]
        if not self.delete(stale):
            self._take_back([e for e in stale if self._can_take_back(e)])

    def record_failure(self, exc: lmdb.Error, num_blocks: int) -> None:
        self.counters.ssd_write_failures += 1
        log.error("event=ssd_write_failed blocks=%d error=%r", num_blocks, exc)

    def _is_on_ssd(self, key: bytes) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry.on_ssd

    def _can_take_back(self, entry: Entry) -> bool:
        if entry.block_id in self.index:
            return False
        return entry.parent_id is None or not chains.closes_cycle_on_return(
            self.index, entry.block_id, entry.parent_id
        )

    def _take_back(self, entries: list[Entry]) -> None:
        """Tracks `entries`, whose records are on SSD, as on SSD again (indexing those that
        left the index); the SSD policy takes them as just arrived."""
        for entry in entries:
            if entry.block_id not in self.index:
                self.index.add(entry)
            self.space.track(entry)
