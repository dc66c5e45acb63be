"""Slots: the slots blocks hold in one memory tier (DRAM or HBM), and those a block left
while readers still held it.

This is the one path, for every memory tier, by which a block gives a slot back. A view
handed to a reader stays valid until its lease ends, so a block that leaves a tier while
leased leaves its slot *stale*: out of the block, still allocated, freed when the block's
last lease ends (`end_lease`).
"""

from __future__ import annotations

from kvstore.store.index import Entry
from kvstore.store.tiers.base import MemoryTier, Slot


class MemorySlots:
    """Stale slots of one memory tier; every method runs under the store's lock."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self._stale: dict[int, tuple[Entry, Slot]] = {}  # id(entry) -> (entry, its old slot)

    def __len__(self) -> int:
        return len(self._stale)

    def release(self, entry: Entry, slot: Slot) -> None:
        """Gives back `slot`, which `entry` no longer holds: now, or once it is unleased."""
        if entry.num_leases == 0:
            self.tier.free(slot)
            return
        assert id(entry) not in self._stale, "a block left a tier twice while leased"
        self._stale[id(entry)] = (entry, slot)

    def end_lease(self, entry: Entry) -> None:
        """Called after `entry`'s lease count drops: frees a slot it left while leased."""
        if self._stale and entry.num_leases == 0:
            stale = self._stale.pop(id(entry), None)
            if stale is not None:
                self.tier.free(stale[1])

    def check(self, num_held: int) -> None:
        """Asserts that the tier's slots are the `num_held` blocks hold, plus the stale."""
        name = self.tier.name
        assert all(e.num_leases > 0 for e, _ in self._stale.values()), f"{name}: stale, unleased"
        num_slots = self.tier.stats().num_slots
        assert num_slots == num_held + len(self._stale), f"{name} slots and entries disagree"
