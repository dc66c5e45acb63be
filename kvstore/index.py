"""The block index: key -> entry (tier, slot, size, checksum, state, leases); prefix match."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tiers.base import Slot


class BlockState(enum.Enum):
    RESERVED = "reserved"  # slot allocated, bytes being written; invisible to readers
    COMMITTED = "committed"  # readable


@dataclass
class Entry:
    """One block. Mutated only by the store, under its lock.

    A committed block lives in DRAM (`slot`), on SSD (`on_ssd`) or both: SSD keeps its copy
    when a block is promoted, so evicting a block that is on SSD from DRAM costs no write.
    A DRAM block may also have a device copy in HBM (`hbm_slot`).
    """

    key: bytes
    namespace_id: bytes
    parent: bytes | None
    nbytes: int
    slot: Slot | None
    state: BlockState = BlockState.RESERVED
    checksum: int = 0
    num_leases: int = 0  # readers, and the demoter while it writes the block out
    on_ssd: bool = False
    seq: int = 0  # commit order
    stale_slot: Slot | None = None  # left DRAM while leased: freed when the last lease ends
    is_demoting: bool = False  # being written to SSD outside the lock; out of the DRAM policy
    num_hits: int = 0  # reads since commit, in any tier
    hbm_slot: Slot | None = None  # device copy of the DRAM block (HBM is inclusive of DRAM)
    stale_hbm_slot: Slot | None = None  # device copy dropped while leased

    @property
    def tier(self) -> str:
        """The fastest tier holding the block."""
        if self.hbm_slot is not None:
            return "hbm"
        return "dram" if self.slot is not None else "ssd"

    @property
    def is_readable(self) -> bool:
        return self.state is BlockState.COMMITTED

    @property
    def is_evictable(self) -> bool:
        return self.state is BlockState.COMMITTED and self.num_leases == 0


class BlockIndex:
    """All entries of one store node, reserved and committed."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def add(self, entry: Entry) -> None:
        assert entry.key not in self._entries, "key already indexed"
        self._entries[entry.key] = entry

    def pop(self, key: bytes) -> Entry:
        return self._entries.pop(key)

    def readable(self, namespace_id: bytes, key: bytes) -> Entry | None:
        """The committed entry for `key` in `namespace_id`, or None."""
        entry = self._entries.get(key)
        if entry is None or not entry.is_readable or entry.namespace_id != namespace_id:
            return None
        return entry

    def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> list[Entry]:
        """Committed entries of the longest present prefix of `keys`."""
        hits = []
        for key in keys:
            entry = self.readable(namespace_id, key)
            if entry is None:
                break
            hits.append(entry)
        return hits
