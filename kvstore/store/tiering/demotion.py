"""Demotion: one pass that cleans DRAM from over its high watermark down to its low one,
writing the dirty victims to SSD in one transaction, without the store's lock."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvstore.store.eviction import BlockHint
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.tiering.dram_space import DramSpace
from kvstore.store.tiering.ssd_writes import SsdWriter

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


class Demotion:
    """Demotion passes; `demote_pass` takes the store's lock `lock` itself."""

    def __init__(
        self,
        config: StoreConfig,
        index: BlockIndex,
        lock: threading.RLock,
        dram: DramSpace,
        writer: SsdWriter,
    ) -> None:
        self.config = config
        self.index = index
        self.lock = lock
        self.dram = dram
        self.writer = writer

    def demote_pass(self) -> int:
        """Frees DRAM down to its low watermark: clean victims at once, dirty ones after an
        SSD write (one transaction, run without the store's lock; the victims are pinned and
        out of the DRAM policy meanwhile). If the write fails, SSD is as it was and the
        victims are dropped (DRAM blocks are a cache), but for those read meanwhile, which
        stay in DRAM. Returns how many blocks left DRAM."""
        dram, writer = self.dram, self.writer
        with self.lock:
            to_write, hints, num_freed = self._select()
            batch = writer.prepare(to_write)
        is_written = writer.run(batch)
        with self.lock:
            for entry in batch.copies:
                dram.end_lease(entry)
            writer.end(batch, is_written)
            for entry in to_write:
                entry.is_demoting = False
                dram.end_lease(entry)
            kept = [e for e in to_write if self.index.get(e.block_id) is e]
            if not is_written:
                return num_freed + self._drop_unwritten(kept)
            writer.finish(kept, hints)
            for entry in kept:
                dram.policy.insert(entry.block_id, entry.parent_id, moved=True)
                if entry.is_evictable:
                    dram.free(entry)
            dram.counters.evictions += len(kept)
            writer.delete_stale([e for e in to_write if self.index.get(e.block_id) is not e])
            return num_freed + len(kept)

    def _select(self) -> tuple[list[Entry], dict[bytes, BlockHint | None], int]:
        """Dirty victims to write out (pinned), after freeing clean ones and dropping those
        the policy will not demote; returns them, the DRAM policy's hints for them, and how
        many blocks were freed."""
        dram = self.dram
        to_write: list[Entry] = []
        hints: dict[bytes, BlockHint | None] = {}
        num_freed = 0
        # With quotas, each tenant over its quota's watermark gives up its own blocks only.
        for tenant, excess in dram.excess(self.config.dram_low_watermark):
            while excess > 0 and (victim := dram.victim(None, tenant)) is not None:
                excess -= victim.nbytes
                if victim.on_ssd or not dram.policy.should_demote(victim.block_id):
                    dram.evict_now(victim)
                    num_freed += 1
                    continue
                hints[victim.block_id] = dram.policy.hint(victim.block_id)
                dram.policy.remove(victim.block_id)
                victim.is_demoting = True
                victim.num_leases += 1
                to_write.append(victim)
        return to_write, hints, num_freed

    def _drop_unwritten(self, entries: list[Entry]) -> int:
        """Drops victims whose SSD write failed; one read meanwhile goes back to the DRAM
        policy instead. Returns how many were dropped."""
        num_dropped = 0
        for entry in entries:
            if entry.is_evictable:
                self.dram.evict_now(entry)
                num_dropped += 1
            else:
                self.dram.policy.insert(entry.block_id, entry.parent_id, moved=True)
        return num_dropped
