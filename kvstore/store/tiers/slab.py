"""Slab allocation over one contiguous pool, shared by the memory tiers (DRAM, HBM).

The pool is cut into slabs of `slab_bytes`; a slab is handed to one size class when that
class runs out of slots and goes back to the free list when its last slot is freed. A block
never spans slabs, so every slot is one contiguous range of the pool.
"""

from __future__ import annotations

from kvstore.store.tiers.base import MemoryTier, Slot, TierStats

_ALIGN = 64  # slots start on cache lines
DEFAULT_SLAB_BYTES = 64 << 20


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _SizeClass:
    """Slots of one size, spread over the slabs this class owns."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.free_by_slab: dict[int, list[int]] = {}  # slab -> free slot offsets
        self.used_by_slab: dict[int, int] = {}  # slab -> slots in use


class SlabTier(MemoryTier):
    """A memory tier whose pool is `capacity_bytes` rounded down to whole slabs.

    Subclasses provide the pool (`view`); this class does all the accounting.

    Args:
        capacity_bytes: size of the pool; rounded down to whole slabs.
        slab_bytes: slab size; a block larger than this cannot be stored here.
    """

    def __init__(self, capacity_bytes: int, slab_bytes: int = DEFAULT_SLAB_BYTES) -> None:
        slab_bytes = min(slab_bytes, capacity_bytes)
        if slab_bytes < _ALIGN:
            raise ValueError(f"capacity_bytes must be at least {_ALIGN}, got {capacity_bytes}")
        self.slab_bytes = slab_bytes - slab_bytes % _ALIGN
        self.num_slabs = capacity_bytes // self.slab_bytes
        self.capacity_bytes = self.num_slabs * self.slab_bytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self._used_bytes = 0
        self._live: dict[int, int] = {}  # offset -> slot size of allocated slots

    def size_class(self, nbytes: int) -> int:
        """Slot size that a block of `nbytes` occupies."""
        return _round_up(max(nbytes, 1), _ALIGN)

    def can_fit(self, nbytes: int) -> bool:
        return nbytes > 0 and self.size_class(nbytes) <= self.slab_bytes

    def has_free_slab(self) -> bool:
        return bool(self._free_slabs)

    def allocate(self, nbytes: int) -> Slot | None:
        if not self.can_fit(nbytes):
            return None
        cls = self._classes.setdefault(self.size_class(nbytes), _SizeClass(self.size_class(nbytes)))
        slab = next(iter(cls.free_by_slab), None)
        if slab is None:
            slab = self._take_slab(cls)
            if slab is None:
                return None
        free = cls.free_by_slab[slab]
        offset = free.pop()
        if not free:
            del cls.free_by_slab[slab]
        cls.used_by_slab[slab] += 1
        self._used_bytes += nbytes
        self._live[offset] = cls.slot_bytes
        return Slot(offset, nbytes)

    def free(self, slot: Slot) -> None:
        size = self.size_class(slot.nbytes)
        assert self._live.get(slot.offset) == size, f"double free of {slot}, or not allocated"
        del self._live[slot.offset]
        cls = self._classes[size]
        slab = slot.offset // self.slab_bytes
        cls.used_by_slab[slab] -= 1
        cls.free_by_slab.setdefault(slab, []).append(slot.offset)
        self._used_bytes -= slot.nbytes
        if cls.used_by_slab[slab] == 0:
            del cls.used_by_slab[slab], cls.free_by_slab[slab]
            self._free_slabs.append(slab)

    def stats(self) -> TierStats:
        return TierStats(self.capacity_bytes, self._used_bytes, len(self._live))

    def _take_slab(self, cls: _SizeClass) -> int | None:
        if not self._free_slabs:
            return None
        slab = self._free_slabs.pop()
        start = slab * self.slab_bytes
        count = self.slab_bytes // cls.slot_bytes
        # Reversed so that pop() hands out slots in address order.
        cls.free_by_slab[slab] = [start + i * cls.slot_bytes for i in range(count - 1, -1, -1)]
        cls.used_by_slab[slab] = 0
        return slab
