"""The contracts of the storage tiers: memory tiers (HBM, DRAM) and persistent ones (SSD).

A tier does no eviction and keeps no index: the store decides what lives where, and calls
a tier's methods under its own lock unless a method says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple


class Slot(NamedTuple):
    """Where one block lives inside a memory tier. Only the tier that made it may read it."""

    offset: int
    nbytes: int


class TierStats(NamedTuple):
    capacity_bytes: int
    used_bytes: int
    num_slots: int


class Tier(ABC):
    """Fixed-capacity storage for blocks."""

    name: str
    capacity_bytes: int

    @abstractmethod
    def can_fit(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` could ever be stored here, given enough frees."""

    @abstractmethod
    def stats(self) -> TierStats:
        """Capacity and usage, in bytes and blocks."""


class MemoryTier(Tier):
    """Byte-addressable memory (DRAM, HBM): blocks live in slots of one preallocated pool."""

    @abstractmethod
    def allocate(self, nbytes: int) -> Slot | None:
        """Reserves space for `nbytes`; returns None (and changes nothing) when full."""

    @abstractmethod
    def free(self, slot: Slot) -> None:
        """Returns `slot` to the tier. The slot's bytes must not be used afterwards."""

    @abstractmethod
    def view(self, slot: Slot) -> Any:
        """Writable view of exactly `slot.nbytes` bytes, valid until `free(slot)`.

        A `memoryview` for host memory; a device array for device memory.
        """

    @abstractmethod
    def size_class(self, nbytes: int) -> int:
        """Bytes of pool a block of `nbytes` occupies."""

    @abstractmethod
    def has_free_slab(self) -> bool:
        """Whether an allocation of any size class could succeed without frees."""


class RecordHeader(NamedTuple):
    """What a persistent tier keeps beside a block's bytes, enough to rebuild the index."""

    namespace_id: bytes
    parent: bytes | None
    checksum: int
    nbytes: int
    seq: int  # commit order, to restore recency after a restart


class Record(NamedTuple):
    key: bytes
    header: RecordHeader
    payload: memoryview | bytes


class PersistentTier(Tier):
    """Blocks that survive a restart (SSD). Writes are batched into atomic transactions.

    Methods may be called without the store's lock from one writer thread while other
    threads read: implementations must allow one writer beside concurrent readers.
    """

    @abstractmethod
    def write(self, records: Sequence[Record], delete: Sequence[bytes] = ()) -> None:
        """Atomically deletes the keys in `delete`, then stores `records`."""

    @abstractmethod
    def rekey(self, moves: Sequence[tuple[bytes, bytes]], delete: Sequence[bytes] = ()) -> None:
        """Atomically moves each record of `moves` from its old key to its new key, and
        deletes the keys in `delete`: all in one transaction (a format migration)."""

    @abstractmethod
    def read_into(self, key: bytes, dest: memoryview) -> RecordHeader | None:
        """Copies the block's bytes into `dest`; None if absent or malformed.

        The bytes are not verified: the caller checks them against `header.checksum`.
        """

    @abstractmethod
    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None]]:
        """Every stored key with its header (None where the header is malformed)."""

    @abstractmethod
    def save_meta(self, name: bytes, value: bytes) -> None:
        """Stores a small metadata value (e.g. a namespace) beside the blocks."""

    @abstractmethod
    def load_meta(self) -> dict[bytes, bytes]:
        """All metadata values."""

    @abstractmethod
    def close(self) -> None:
        """Flushes and releases the tier; no method may be called afterwards."""
