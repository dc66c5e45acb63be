"""SSD space: which blocks are on SSD, in what order they go, and what makes room there.

SSD is inclusive: a promoted block keeps its SSD record, so evicting a clean block from
DRAM is free. Under pressure the SSD copies of blocks still in DRAM (`redundant`) go first:
the block stays servable, and SSD holds DRAM + SSD distinct blocks instead of SSD alone.
Only then do SSD-only blocks leave the store, in the SSD policy's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvstore.index import BlockIndex, Entry
from kvstore.policy import BlockHint, EvictionPolicy
from kvstore.tiering.usage import TieringCounters
from tiers.ssd import SsdTier

if TYPE_CHECKING:
    from kvstore.store_config import StoreConfig


class SsdSpace:
    """The SSD policy and the tracking of blocks on SSD; runs under the store's lock.

    It changes memory only: whoever gives a copy up here deletes its record (`SsdWriter`).
    """

    def __init__(
        self,
        config: StoreConfig,
        index: BlockIndex,
        ssd: SsdTier,
        policy: EvictionPolicy,
        counters: TieringCounters,
    ) -> None:
        self.config = config
        self.index = index
        self.ssd = ssd
        self.policy = policy
        self.counters = counters
        self._redundant: dict[bytes, Entry] = {}  # on SSD and in DRAM, oldest first

    def track(self, entry: Entry, hint: BlockHint | None = None, is_reused: bool = False) -> None:
        """Tracks `entry`, whose record is on SSD, as on SSD; `hint`: the DRAM policy's, for
        a demoted block; `is_reused`: read in DRAM, which the SSD policy hears of too."""
        entry.on_ssd = True
        if entry.slot is not None:
            self._redundant[entry.block_id] = entry
        self.policy.insert(entry.block_id, entry.parent_id, moved=True, hint=hint)
        if is_reused:
            self.policy.touch([entry.block_id])

    def untrack(self, entry: Entry) -> None:
        """Forgets the SSD copy of `entry` (the caller deletes the record)."""
        self.policy.remove(entry.block_id)
        self._redundant.pop(entry.block_id, None)
        entry.on_ssd = False

    def add_dram_copy(self, entry: Entry) -> None:
        """`entry`, on SSD, has just got a DRAM slot (a promotion)."""
        self._redundant[entry.block_id] = entry

    def drop_dram_copy(self, entry: Entry) -> None:
        """`entry` is leaving DRAM."""
        self._redundant.pop(entry.block_id, None)

    def touch(self, entries: Sequence[Entry]) -> None:
        self.policy.touch([e.block_id for e in entries if e.on_ssd])

    def make_room(self, needed: int) -> tuple[list[Entry], list[Entry]]:
        """Gives up SSD copies until `needed` more bytes fit, for the write that follows to
        delete. Returns the copies of blocks still in DRAM (pinned until that write ends),
        and those of blocks it dropped (out of the index)."""
        cap = self.ssd.capacity_bytes
        used = self.ssd.stats().used_bytes
        copies: list[Entry] = []
        dropped: list[Entry] = []
        if used + needed <= self.config.ssd_high_watermark * cap:
            return copies, dropped
        target = self.config.ssd_low_watermark * cap - needed
        while used > target and self._redundant:
            entry = next(iter(self._redundant.values()))
            entry.num_leases += 1  # stays in DRAM till the write ends: if it fails, back on SSD
            copies.append(entry)
            self._give_up(entry)
            used -= entry.nbytes
        while used > target:
            victims = self._victims(used - target)
            if not victims:
                break
            for entry in victims:
                dropped.append(entry)
                self._give_up(entry)
                used -= entry.nbytes
        return copies, dropped

    def check(self, committed: Iterable[Entry]) -> None:
        """Asserts that policy, records and `committed` (every committed block) agree."""
        committed = list(committed)
        assert sum(e.on_ssd for e in committed) == len(self.policy), "SSD policy"
        assert self.ssd.stats().num_slots == len(self.policy), "SSD records and entries"
        both = {e.block_id for e in committed if e.slot is not None and e.on_ssd}
        assert set(self._redundant) == both, "redundant copies are mistracked"

    def _victims(self, nbytes: float) -> list[Entry]:
        """Evictable SSD entries in policy order, enough to free `nbytes` (one pass)."""
        victims = []
        for key in self.policy.candidates():
            if nbytes <= 0:
                break
            entry = self.index.get(key)
            assert entry is not None and entry.on_ssd, "SSD policy is stale"
            if entry.num_leases == 0:
                victims.append(entry)
                nbytes -= entry.nbytes
        return victims

    def _give_up(self, entry: Entry) -> None:
        """Forgets the SSD copy; drops a block left nowhere."""
        self.untrack(entry)
        if entry.slot is None:
            self.index.pop(entry.block_id)
            self.counters.drops += 1
