"""Reservations: blocks reserved by one `reserve` call, written in place, then committed.

A reservation belongs to its owner (`kvstore.limits`): to any other client it is unknown.
Its blocks are RESERVED entries of the index, each with a DRAM slot, invisible to readers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.limits import OwnerCounts
from kvstore.store.index import BlockState, Entry

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


@dataclass
class Reservation:
    namespace_id: bytes
    entries: dict[int, Entry]  # index in the reserve call -> reserved entry
    views: dict[int, memoryview]  # index -> writable view of the entry's DRAM slot
    expires_at: float
    owner: str  # the client that holds it (`kvstore.limits`)
    sums: dict[int, int] = field(default_factory=dict)  # index -> CRC32C the node computed
    written: dict[int, int] = field(init=False)  # index -> bytes written so far, in order

    def __post_init__(self) -> None:
        self.written = dict.fromkeys(self.entries, 0)

    def entry(self, reservation_id: int, index: int) -> Entry:
        """Reserved block `index`; InvalidArgumentError if the call reserved none there."""
        entry = self.entries.get(index)
        if entry is None:
            raise errors.InvalidArgumentError(f"block {index} is not reserved by {reservation_id}")
        return entry

    def check_chunk(self, reservation_id: int, index: int, offset: int, nbytes: int) -> Entry:
        """The entry that `nbytes` at `offset` of block `index` go to, if they may."""
        entry = self.entry(reservation_id, index)
        if offset != self.written[index]:
            raise errors.InvalidArgumentError(
                f"block {index}: chunk at offset {offset}, expected {self.written[index]}"
            )
        end = offset + nbytes
        if end > entry.nbytes:
            raise errors.PayloadSizeError(
                f"block {index}: {end} bytes written, block size is {entry.nbytes}"
            )
        return entry

    def write(self, reservation_id: int, index: int, offset: int, data: memoryview | bytes) -> None:
        """Writes the next chunk of block `index`, if it is the next and fits."""
        self.check_chunk(reservation_id, index, offset, len(data))
        end = offset + len(data)
        self.views[index][offset:end] = data
        self.written[index] = end

    def view(self, reservation_id: int, index: int) -> memoryview:
        self.entry(reservation_id, index)
        return self.views[index]

    def mark_written(self, reservation_id: int, index: int, crc: int | None) -> None:
        """Block `index` is written whole (through its view); `crc`: its CRC32C, if known."""
        self.written[index] = self.entry(reservation_id, index).nbytes
        if crc is not None:
            self.sums[index] = crc

    def mark_all_written(self, reservation_id: int, crcs: Mapping[int, int]) -> None:
        """Every block is written whole, summed to `crcs` (one per reserved block)."""
        if set(crcs) != set(self.entries):
            raise errors.InvalidArgumentError(
                f"reservation {reservation_id}: sums for blocks {sorted(crcs)[:8]}, "
                f"reserved are {sorted(self.entries)[:8]}"
            )
        for i, crc in crcs.items():
            self.mark_written(reservation_id, i, crc)

    def mismatched(self, crcs: Mapping[int, int], checksums: Sequence[int] | None) -> list[int]:
        """The blocks whose sum differs from the sender's `checksums` (none if it sent none)."""
        if checksums is None:
            return []
        return [i for i in crcs if crcs[i] != checksums[i]]

    def seal(self, crcs: Mapping[int, int]) -> int:
        """Marks every block committed with its CRC32C; returns the bytes committed."""
        for i, entry in self.entries.items():
            entry.checksum = crcs[i]
            entry.state = BlockState.COMMITTED
        return sum(e.nbytes for e in self.entries.values())

    def checksums(self) -> dict[int, int]:
        """The CRC32C of each block, summing those the node did not sum as they landed
        (without the store's lock: the slots are this reservation's)."""
        return {i: self.sums[i] if i in self.sums else checksum(v) for i, v in self.views.items()}

    def rewind(self, index: int, offset: int) -> None:
        """Back to `offset` bytes written, unless block `index` is written whole."""
        entry = self.entries.get(index)
        if entry is None or self.written[index] == entry.nbytes:
            return
        self.written[index] = min(self.written[index], offset)
        self.sums.pop(index, None)

    def check_complete(self) -> None:
        """Raises `IncompleteWriteError` unless every block is written whole."""
        short = [i for i, e in self.entries.items() if self.written[i] != e.nbytes]
        if short:
            raise errors.IncompleteWriteError(
                f"blocks {short[:8]} are not fully written; "
                f"each needs {next(iter(self.entries.values())).nbytes} bytes"
            )


class Reservations:
    """The open reservations of a store by id, counted per owner against the limits."""

    def __init__(self, config: StoreConfig) -> None:
        self._open: dict[int, Reservation] = {}
        self._counts = OwnerCounts(
            "reservations",
            config.max_reservations_per_client,
            config.max_reservations,
            errors.TooManyReservationsError,
        )

    def __len__(self) -> int:
        return len(self._open)

    @property
    def num_entries(self) -> int:
        return sum(len(r.entries) for r in self._open.values())

    def check_limit(self, owner: str) -> None:
        """Raises `TooManyReservationsError` if `owner` may open no other reservation."""
        self._counts.check(owner)

    def open(self, reservation_id: int, res: Reservation) -> None:
        self._open[reservation_id] = res
        self._counts.add(res.owner)

    def close(self, reservation_id: int) -> Reservation:
        res = self._open.pop(reservation_id)
        self._counts.remove(res.owner)
        return res

    def get(self, reservation_id: int) -> Reservation | None:
        return self._open.get(reservation_id)

    def owned(self, reservation_id: int, owner: str) -> Reservation:
        """The open reservation `owner` holds as `reservation_id`; else an unknown one."""
        res = self._open.get(reservation_id)
        if res is None or res.owner != owner:
            raise errors.UnknownReservationError(
                f"no open reservation {reservation_id} (committed, aborted or expired)"
            )
        return res

    def expired(self, now: float) -> list[int]:
        return [r for r, res in self._open.items() if res.expires_at <= now]

    def check(self) -> None:
        assert len(self._counts) == len(self._open), "reservation counts"
