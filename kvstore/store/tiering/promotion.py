"""Promotion: a block read from SSD gets a DRAM slot again, keeping its SSD record.

When DRAM is all leased the read is served from a private buffer instead, and the block
stays on SSD only. Either way the bytes are checked against the block's checksum.
"""

from __future__ import annotations

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.store.index import Entry
from kvstore.store.tiering.dram_space import DramSpace
from kvstore.store.tiering.ssd_space import SsdSpace
from kvstore.store.tiering.usage import TieringCounters


class Promotion:
    """Reads of SSD blocks; every method runs under the store's lock."""

    def __init__(self, dram: DramSpace, space: SsdSpace, counters: TieringCounters) -> None:
        self.dram = dram
        self.space = space
        self.counters = counters

    def promote(self, entry: Entry) -> memoryview | None:
        """A view of SSD block `entry`'s bytes, in DRAM if a slot could be had; None, having
        changed nothing, when its record is missing or fails its checksum."""
        assert entry.on_ssd
        entry.num_leases += 1  # pinned: allocating below must not evict it from SSD
        try:
            tenant = self.dram.tenant_of(entry.namespace_id)  # charged to its tenant
            slot = self.dram.allocate(entry.nbytes, 1, tenant)[0]
        except errors.StoreFullError:
            slot = None  # DRAM is all leased: serve from a private buffer, no promotion
        finally:
            entry.num_leases -= 1
        tier = self.dram.tier
        view = tier.view(slot) if slot is not None else memoryview(bytearray(entry.nbytes))
        header = self.space.ssd.read_into(entry.block_id, view)
        if header is None or checksum(view) != entry.checksum:
            if slot is not None:
                tier.free(slot)
            return None
        if slot is not None:
            entry.slot = slot
            self.dram.index.note(entry)
            self.space.add_dram_copy(entry)
            self.dram.policy.insert(entry.block_id, entry.parent_id, moved=True)
            self.counters.promotions += 1
            self.counters.tiers["dram"].bytes_written += entry.nbytes
        return view
