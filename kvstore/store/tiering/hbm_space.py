"""The HBM tier of a node: device copies of DRAM blocks, for readers of device memory.

HBM is inclusive of DRAM. A block read by a reader that takes device memory (the UCX data
plane, whose transports move device memory: CUDA IPC on one host, GPUDirect across hosts)
is copied up into HBM after that read, evicting by the HBM tier's own policy, and keeps
its DRAM slot. Its next such reads are served from the device copy, with no host hop.
Dropping a device copy therefore costs nothing, and a block that leaves DRAM leaves HBM
too (`forget`), so HBM never holds the only copy of a block.

Checksums are checked where the bytes come from (the DRAM copy, when `verify_reads` is on,
before the copy up); device memory is not summed again on reads.

Everything the store knows of HBM is here; the device pool itself is `kvstore.store.tiers.hbm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.store.eviction import EvictionPolicy, make_policy
from kvstore.store.index import Entry
from kvstore.store.tiering.slots import MemorySlots
from kvstore.store.tiering.usage import TierCounters
from kvstore.store.tiers.hbm import HbmTier

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


class HbmCache:
    """Device copies of DRAM blocks; every method runs under the store's lock."""

    def __init__(self, tier: HbmTier, policy: EvictionPolicy, counters: TierCounters) -> None:
        self.tier = tier
        self.policy = policy
        self.counters = counters
        self._slots = MemorySlots(tier)
        self._entries: dict[bytes, Entry] = {}  # block id -> block with a device copy

    @classmethod
    def from_config(cls, config: StoreConfig, counters: TierCounters) -> HbmCache | None:
        """The HBM tier `config` asks for (`hbm_bytes`), or None without one."""
        if not config.hbm_bytes:
            return None
        tier = HbmTier(config.hbm_bytes, config.slab_bytes, config.hbm_device)
        return cls(tier, make_policy(config.policy), counters)

    def __len__(self) -> int:
        return len(self._entries)

    def view(self, entry: Entry) -> Any | None:
        """The device copy of a block, or None when it has none."""
        if entry.hbm_slot is None:
            return None
        return self.tier.view(entry.hbm_slot)  # counted as a hit by the read that asked

    def admit_read(self, entries: Sequence[Entry], views: Sequence[Any]) -> int:
        """Gives the blocks a device reader just read from DRAM a device copy; `views[i]` is
        what the read got for `entries[i]`. Returns how many were copied."""
        from_dram = [
            (e, v)
            for e, v in zip(entries, views, strict=True)
            if isinstance(v, memoryview) and e.slot is not None  # not a private SSD read
        ]
        return self.admit([e for e, _ in from_dram], [v for _, v in from_dram])

    def admit(self, entries: Sequence[Entry], host_views: Sequence[memoryview]) -> int:
        """Copies up the blocks that have no device copy yet, in chain order, evicting by
        policy; stops at the first that finds HBM full of leased blocks. Returns how many
        were copied."""
        num_copied = 0
        for entry, view in zip(entries, host_views, strict=True):
            if entry.hbm_slot is not None:
                continue
            slot = self.tier.allocate(entry.nbytes)
            while slot is None and self._evict_one():
                slot = self.tier.allocate(entry.nbytes)
            if slot is None:
                break
            self.tier.write_from(slot, view)
            entry.hbm_slot = slot
            self._entries[entry.block_id] = entry
            self.policy.insert(entry.block_id, entry.parent_id, moved=True)
            self.counters.bytes_written += entry.nbytes
            num_copied += 1
        if num_copied:
            self.tier.synchronize()  # a sender may read the copies as soon as the lock goes
        return num_copied

    def touch(self, entries: Sequence[Entry]) -> None:
        self.policy.touch([e.block_id for e in entries if e.hbm_slot is not None])

    def forget(self, entry: Entry) -> None:
        """Drops a block's device copy (the block is leaving DRAM); a leased copy is freed
        when its last lease ends."""
        if entry.hbm_slot is None:
            return
        del self._entries[entry.block_id]
        self.policy.remove(entry.block_id)
        self._slots.release(entry, entry.hbm_slot)
        entry.hbm_slot = None

    def end_lease(self, entry: Entry) -> None:
        """Called after a lease count drops; frees a copy dropped while it was leased."""
        self._slots.end_lease(entry)

    def check(self, entries: Iterable[Entry]) -> None:
        """Asserts that the device copies of `entries` (every indexed block) are tracked."""
        on_hbm = [e for e in entries if e.hbm_slot is not None]
        assert all(e.slot is not None for e in on_hbm), "HBM holds a block DRAM lost"
        assert len(on_hbm) == len(self._entries) == len(self.policy), "HBM policy and entries"
        self._slots.check(len(on_hbm))

    def _evict_one(self) -> bool:
        for key in self.policy.candidates():
            entry = self._entries[key]
            if entry.num_leases == 0:
                self.forget(entry)
                return True
        return False
