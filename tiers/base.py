"""The contract every storage tier (HBM, DRAM, SSD) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple


class Slot(NamedTuple):
    """Where one block lives inside a tier. Only the tier that made it may interpret it."""

    offset: int
    nbytes: int


class TierStats(NamedTuple):
    capacity_bytes: int
    used_bytes: int
    num_slots: int


class Tier(ABC):
    """Fixed-capacity storage for blocks, addressed by `Slot`.

    A tier does no eviction and keeps no index: the store decides what lives where and
    frees slots itself. Methods are not thread-safe; the store serializes calls.
    """

    name: str

    @abstractmethod
    def allocate(self, nbytes: int) -> Slot | None:
        """Reserves space for `nbytes`; returns None (and changes nothing) when full."""

    @abstractmethod
    def free(self, slot: Slot) -> None:
        """Returns `slot` to the tier. The slot's bytes must not be used afterwards."""

    @abstractmethod
    def view(self, slot: Slot) -> memoryview:
        """Writable view of exactly `slot.nbytes` bytes, valid until `free(slot)`."""

    @abstractmethod
    def can_fit(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` could ever be allocated here, given enough frees."""

    @abstractmethod
    def stats(self) -> TierStats:
        """Capacity and usage, in bytes and slots."""
